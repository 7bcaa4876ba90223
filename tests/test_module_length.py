"""The module-length check (tests/module_length.py): what it flags on a small tree made here, and that
torchtpu/ passes it."""

from __future__ import annotations

import os

from tests import module_length


def _module(root, rel, lines):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("x = 1\n" * lines)


def test_a_long_module_is_flagged_and_one_at_the_limit_is_not(tmp_path):
    _module(tmp_path, "torchtpu/train/long.py", 11)
    _module(tmp_path, "torchtpu/train/at_limit.py", 10)
    _module(tmp_path, "torchtpu/backend/ops/family.py", 50)  # op lowerings are exempt
    _module(tmp_path, "bench/long_bench.py", 50)  # outside torchtpu/
    found = module_length.findings(str(tmp_path), allowed={}, limit=10)
    assert found == ["torchtpu/train/long.py: 11 lines; at most 10 (split it by what its parts do)"]


def test_the_allow_list_only_shrinks(tmp_path):
    _module(tmp_path, "torchtpu/still_long.py", 11)
    _module(tmp_path, "torchtpu/split.py", 10)
    allowed = {"torchtpu/still_long.py": "", "torchtpu/split.py": "", "torchtpu/gone.py": ""}
    found = module_length.findings(str(tmp_path), allowed=allowed, limit=10)
    assert found == [
        "torchtpu/gone.py: on OVER_THE_LIMIT but not a checked module; remove it from the list",
        "torchtpu/split.py: 10 lines, within 10; remove it from OVER_THE_LIMIT",
    ]


def test_torchtpu_passes():
    assert "torchtpu/backend/ops/pointwise.py" not in module_length.modules(module_length.REPO)
    assert module_length.findings() == []
