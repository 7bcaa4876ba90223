"""The documents say what is true now: a check of README.md, BENCHMARKS.md and docs/ (`make lint`).

    python -m tests.docs_lint          # exit 1 and one line per finding: file:line: the rule and the words

Rules, applied to the prose of each file (fenced code blocks and `inline code` are left out, so
commands and quoted log lines may say anything):

- README.md has at most README_MAX_LINES lines.
- No history wording. History lives in git; a document says how things are. Whole words,
  case-insensitive:
  - `was`, `were` (past-tense narration: "the figure was 31 GiB");
  - `session`, `sessions` ("the fourth session");
  - `previously`, `formerly`, `used to`, `no longer`, `anymore`, `from now on`;
  - `until` followed by a date, `now`, `recently`, `then` or `(it|that|this) is fixed`
    ("until 2026-12-01"), or by a past-tense verb within 5 words that is not after is/are/be/
    been/has/have ("until the bench costed both"); `until` for a condition ("waits until the
    save ends", "until the checkpoint is saved") is fine;
  - `before` as a comparison with an earlier state: `as before`, `before:`, `before,`,
    `before)`; `before` followed by a date, a commit hash, `now`, `then`, `the fix`, or a
    `change(s)` within 5 words ("before the real-RoPE change"); `before ...:` within a clause
    ("before stacked storage: 319 s"); a figure followed by `before` ("31.00 before", "58.9%
    before"); `measured/figure(s)/run(s) before`. `before` for an order of events ("checked
    before the step", "before paying for chips") is fine;
  - an issue number (`issue 13`, `issues 2 and 3`); an upstream reference such as
    `pytorch/pytorch#161129` is fine.
- ALLOWED lists the exact phrases exempted from a rule (with the reason); keep it short.

Each document has a switch (CHECK_README, CHECK_BENCHMARKS, CHECK_DOCS); all are on.
"""

from __future__ import annotations

import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The switch for README.md (its length and its wording).
CHECK_README = True
README_MAX_LINES = 250

# Documents checked besides README.md: BENCHMARKS.md and every Markdown file under docs/.
CHECK_BENCHMARKS = True
CHECK_DOCS = True

_DATE = r"\d{4}-\d\d-\d\d"
_HISTORY = [
    ("past tense", re.compile(r"\b(was|were)\b", re.I)),
    ("a session", re.compile(r"\bsessions?\b", re.I)),
    ("a change over time", re.compile(r"\b(previously|formerly|used to|no longer|anymore|from now on)\b", re.I)),
    (
        "until a point in time",
        re.compile(
            rf"\buntil\s+({_DATE}|now\b|recently\b|then\b|(it|that|this)\s+is\s+fixed\b)"
            # "until the bench costed both": a past-tense verb (not after is/are/be/has/have) within 5 words
            r"|\buntil\s+(?:(?!(?:is|are|be|been|has|have)\b)\S+\s+){1,5}?(?:ran|was|were|had|did|\w+ed)\b",
            re.I,
        ),
    ),
    (
        "a comparison with an earlier state",
        re.compile(
            rf"\bas\s+before\b|\bbefore\s*[:,)]|\bbefore\s+({_DATE}|[0-9a-f]{{7,40}}\b|now\b|then\b|the\s+fix\b|"
            r"the\s+changes?\b|this\s+change\b|these\s+changes\b)"
            # "before the int32/real-RoPE change", "before stacked storage: 319 s"
            r"|\bbefore\s+(?:[^\s.;:()]+\s+){0,4}?changes?\b|\bbefore\s+[^.;:()]{1,40}:"
            # "31.00 before the table mode", "58.9% before ...", "measured before"
            r"|\d(?:\s*(?:%|[KMGT]i?B|ms|s|x))?\s+before\b|\b(?:measured|figures?|runs?)\s+before\b",
            re.I,
        ),
    ),
    ("an issue number", re.compile(r"\bissues?\s+#?\d+", re.I)),
]

# (file relative to the repository, exact phrase, why it is not history)
ALLOWED: list[tuple[str, str, str]] = []

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")


def prose_lines(text: str):
    """(line number, text) of each line outside fenced code blocks, with `inline code` blanked."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, _INLINE_CODE.sub("``", line)


def history_findings(text: str, allowed=()) -> list[tuple[int, str, str]]:
    """(line number, rule, matched words) for each piece of history wording in a Markdown text.
    A phrase of `allowed` is left out of the lines that contain it."""
    out = []
    for number, line in prose_lines(text):
        for phrase in allowed:
            line = line.replace(phrase, "")
        for rule, pattern in _HISTORY:
            for m in pattern.finditer(line):
                out.append((number, rule, m.group(0)))
    return out


def checked_files() -> list[str]:
    files = []
    if CHECK_README:
        files.append("README.md")
    if CHECK_BENCHMARKS:
        files.append("BENCHMARKS.md")
    if CHECK_DOCS:
        for root, _, names in os.walk(os.path.join(REPO, "docs")):
            files += sorted(os.path.relpath(os.path.join(root, n), REPO) for n in names if n.endswith(".md"))
    return files


def findings() -> list[str]:
    """Every problem in the checked documents, one line each."""
    out = []
    if CHECK_README:
        n = len(open(os.path.join(REPO, "README.md"), encoding="utf-8").read().splitlines())
        if n > README_MAX_LINES:
            out.append(f"README.md: {n} lines; at most {README_MAX_LINES} (move detail to docs/<topic>.md)")
    for name in checked_files():
        text = open(os.path.join(REPO, name), encoding="utf-8").read()
        allowed = [phrase for f, phrase, _ in ALLOWED if f == name]
        for number, rule, words in history_findings(text, allowed):
            out.append(f"{name}:{number}: history wording ({rule}): {words!r}; say what is true now")
    return out


def main() -> int:
    problems = findings()
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
