import gc
import os

import pytest

from tests.processes import cpu_flags

# Every test runs the tpu device on 8 virtual XLA CPU devices (and XLA:CPU's quick code generation:
# tests/processes.py says why).
os.environ.setdefault("XLA_FLAGS", cpu_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The dry run's cache of compile reports is off: a test's dry run compiles (and so sees its own
# monkeypatches); tests/train/test_dry_run_cache.py turns it on in a folder of its own.
os.environ["TORCHTPU_DRY_RUN_CACHE"] = "off"


def pytest_sessionstart(session):
    """PyTorch's CPU work (the oracles) runs on one intra-op thread: the cores are also the XLA CPU
    devices' and, under `make test`, the other pytest-xdist worker's; a second torch thread spends its
    time spinning for a busy core (a transformers greedy decode measured 8x the CPU time of one
    thread on a loaded machine, with the same tokens)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def keep_current_mesh():
    """Restore the process's current device mesh after a test that sets its own (a trainer or a
    sharded run does), so the tests after it find theirs. Modules that need it declare
    `pytestmark = pytest.mark.usefixtures("keep_current_mesh")`."""
    from torchtpu.distributed import mesh

    before = mesh.current_mesh()
    yield
    mesh.set_mesh(before)


def assert_close_to_cpu(actual, expected, msg="", *, rtol, atol):
    """`actual` must be a tensor on the tpu device and `expected` PyTorch's result on CPU; their
    values agree within rtol/atol. The tolerances have no default: every caller states its own.

    A test module binds its usual tolerance once, e.g. `close = partial(assert_close_to_cpu, **TOL)`,
    and overrides it per call where a comparison needs another one.
    """
    import torch

    prefix = f"{msg}: " if msg else ""
    assert isinstance(actual, torch.Tensor) and actual.device.type == "tpu", (
        f"{prefix}expected a tpu tensor, got {type(actual).__name__} on {getattr(actual, 'device', None)}"
    )
    assert isinstance(expected, torch.Tensor) and expected.device.type == "cpu", (
        f"{prefix}the reference must be a CPU tensor, got {type(expected).__name__} on "
        f"{getattr(expected, 'device', None)}"
    )
    torch.testing.assert_close(
        actual.detach().cpu(), expected.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{prefix}{m}"
    )


def pytest_configure(config):
    # the OpInfo pass-rate check over the whole session, on the results every worker's tests report
    from tests.opinfo.pass_rate import register

    register(config)
    # per-test CPU seconds into $SUITE_CPU_TIMES, when set (tests/durations.py)
    from tests.durations import register as register_cpu_times

    register_cpu_times(config)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test` runs `-n 2 --dist loadgroup`) the tests that share a
    module-scoped fixture run on one worker, so the fixture is built once, not once per worker that
    happens to receive one of them (the trainer's and the launcher's reference runs take minutes).
    The group is named by the module and the fixture; tests without one are spread as before."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        for name in info.names_closure:
            defs = info.name2fixturedefs.get(name)
            if defs and defs[-1].scope == "module":
                item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}::{name}"))
                break
    # Longest work unit first, by the suite's recorded durations (tests/durations.py), so the two
    # workers end together: `make test` passes --no-loadscope-reorder, so xdist keeps this order.
    from tests.durations import load, run_order

    units = []
    for item in items:
        group = item.get_closest_marker("xdist_group")
        units.append((group.args[0] if group else item.nodeid, item.nodeid))
    items[:] = [items[i] for i in run_order(units, load())]


def pytest_collection_finish(session):
    """What exists once the tests are collected (torch, JAX, the OpInfo database, the collected items)
    lives as long as the process: moved out of the garbage collector's sight, the full collections
    that a test's allocations trigger stop walking it. On three backend test files in one process
    this took GC from 25.1 to 18.5 CPU seconds, and the files from 96.9 to 88.6."""
    gc.collect()
    gc.freeze()
