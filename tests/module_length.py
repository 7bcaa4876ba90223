"""No module of torchtpu/ is longer than MAX_LINES lines (`make lint`).

    python -m tests.module_length      # exit 1 and one line per finding

A module that long holds several things, and each deserves its own file. The op lowerings under
torchtpu/backend/ops/ are exempt: each file is one family of small independent functions.

OVER_THE_LIMIT names the modules that pass the limit today, each waiting to be split. The list
only shrinks: a module on it that is back within the limit (or gone) is a finding too, naming
the entry to remove, and a module not on it may not pass the limit.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MAX_LINES = 600
EXEMPT = ("torchtpu/backend/ops/",)

# (module, why it is long): split each, then remove its line.
OVER_THE_LIMIT: dict[str, str] = {}


def line_count(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def modules(root: str) -> list[str]:
    """Every .py file under root/torchtpu outside EXEMPT, relative to root, with '/' separators."""
    found = []
    for folder, _, names in os.walk(os.path.join(root, "torchtpu")):
        for name in names:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
                if not rel.startswith(EXEMPT):
                    found.append(rel)
    return sorted(found)


def findings(root: str = REPO, allowed=None, limit: int = MAX_LINES) -> list[str]:
    """One line per module over the limit and not allowed, and per allowed module that is not."""
    allowed = OVER_THE_LIMIT if allowed is None else allowed
    lengths = {rel: line_count(os.path.join(root, rel)) for rel in modules(root)}
    out = []
    for rel, n in lengths.items():
        if n > limit and rel not in allowed:
            out.append(f"{rel}: {n} lines; at most {limit} (split it by what its parts do)")
    for rel in sorted(allowed):
        if rel not in lengths:
            out.append(f"{rel}: on OVER_THE_LIMIT but not a checked module; remove it from the list")
        elif lengths[rel] <= limit:
            out.append(f"{rel}: {lengths[rel]} lines, within {limit}; remove it from OVER_THE_LIMIT")
    return out


def main() -> int:
    problems = findings()
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
