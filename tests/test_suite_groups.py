"""`make test` runs `pytest -n 2 --dist loadgroup`, and tests/conftest.py puts the tests that share a
module-scoped fixture into one xdist group, so the fixture (a trainer's reference run, a launched
job, a vLLM engine) is built once. pytest-xdist applies a group by appending '@group' to the test's
id in the worker; where a pytest / pytest-xdist pairing loses that append (pytest 9.2 with
pytest-xdist 3.8), the tests spread over both workers, each fixture is built two or three times
and the suite runs longer with every test still passing (2,129 s against 1,941 s here with an empty
compilation cache). This test fails instead."""

import pytest


@pytest.fixture(scope="module")
def shared():
    return object()


def test_module_fixture_groups_reach_xdist(shared, request):
    config = request.config
    if not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
        pytest.skip("runs under `pytest -n N --dist loadgroup` (make test)")
    import xdist

    assert request.node.get_closest_marker("xdist_group") is not None  # conftest grouped it
    assert request.node.nodeid.endswith("@tests.test_suite_groups::shared"), (
        f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} drops --dist loadgroup's groups "
        f"(test id {request.node.nodeid!r} has no '@group'): install the versions pyproject.toml's dev extra "
        "pins (pip install -e '.[dev]')"
    )
