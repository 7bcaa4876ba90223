"""The suite's run order (tests/durations.py): work units longest first, each unit's tests together."""

import json

from tests import durations


def test_units_run_longest_first_and_stay_whole():
    units = [
        ("tests/backend/test_a.py::t1", "tests/backend/test_a.py::t1"),
        ("g", "tests/train/test_b.py::t1"),
        ("tests/opinfo/test_opinfo.py::f", "tests/opinfo/test_opinfo.py::f"),
        ("g", "tests/train/test_b.py::t2"),
        ("tests/launch/test_c.py::t", "tests/launch/test_c.py::t"),
    ]
    seconds = {
        "tests/backend/test_a.py::t1": 50.0,
        "tests/train/test_b.py::t1": 30.0,
        "tests/train/test_b.py::t2": 40.0,
    }
    # g: 70 s recorded; the launch test unknown (its directory's 30 s); a: 50 s; the OpInfo test unknown (0.5 s)
    assert durations.run_order(units, seconds) == [1, 3, 0, 4, 2]


def test_records_keep_the_longest_wall_time_of_a_test(tmp_path):
    path = tmp_path / "times.jsonl"
    rows = [
        {"test": "tests/x.py::a", "cpu": 1.0, "wall": 3.0},
        {"test": "tests/x.py::a", "cpu": 1.0, "wall": 5.0},
        {"test": "tests/x.py::b", "cpu": 0.1, "wall": 0.2},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert durations.from_records([str(path)]) == {"tests/x.py::a": 5.0}
    assert durations.base_id("tests/x.py::a@tests.x::fixture") == "tests/x.py::a"
