"""The documents and the code's comments say what is true now: a check of README.md, BENCHMARKS.md,
docs/ and the comments and docstrings of torchtpu/ (`make lint`).

    python -m tests.docs_lint          # exit 1 and one line per finding: file:line: the rule and the words

Rules, applied to the prose of each document (fenced code blocks and `inline code` are left out, so
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
- No dates: `2026-12-06`, `Dec 2026`, `December 6, 2026`, `6 Dec 2026`. A figure is as old as the
  commit that wrote it, and git says when that was.
- No commit hashes: 7 to 40 hexadecimal digits with at least one letter and one digit (`8cdf04b`);
  a number in scientific notation (`5.8981e13`) is not one. A figure belongs to the code it sits
  beside; one measured on other code says in words what differed ("with the two-kernel attention
  backward").
- ALLOWED lists the exact phrases exempted from a rule (with the reason); keep it short.

Each document has a switch (CHECK_README, CHECK_BENCHMARKS, CHECK_DOCS); all are on.

The comments and docstrings of every module under torchtpu/ (CHECK_CODE) follow the same rules with
what differs in code (CODE_HISTORY): a comment narrates what a program does at run time in the past
tense ("the tensor it was traced with", "the peak was reset"), so `was`/`were` count only before a
figure or a verb of editing ("was 31 GiB", "was renamed"); an order of events with a colon ("before
libtpu starts: ...") is fine; "quoted text" is left out like `inline code` (a quoted error message
may say anything).
"""

from __future__ import annotations

import io
import os
import re
import sys
import tokenize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The switch for README.md (its length and its wording).
CHECK_README = True
README_MAX_LINES = 250

# Documents checked besides README.md: BENCHMARKS.md and every Markdown file under docs/.
CHECK_BENCHMARKS = True
CHECK_DOCS = True

# The comments and docstrings of torchtpu/ (CODE_HISTORY, dates and commit hashes).
CHECK_CODE = True

_DATE = r"\d{4}-\d\d-\d\d"
_PAST_TENSE = ("past tense", re.compile(r"\b(was|were)\b", re.I))
_COMMON_HISTORY = [
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
            # "before the int32/real-RoPE change"
            r"|\bbefore\s+(?:[^\s.;:()]+\s+){0,4}?changes?\b"
            # "31.00 before the table mode", "58.9% before ...", "measured before"
            r"|\d(?:\s*(?:%|[KMGT]i?B|ms|s|x))?\s+before\b|\b(?:measured|figures?|runs?)\s+before\b",
            re.I,
        ),
    ),
    ("an issue number", re.compile(r"\bissues?\s+#?\d+", re.I)),
]
# "before stacked storage: 319 s": in a document, a `before` clause ending in a colon compares states;
# in a comment it is an order of events ("before libtpu starts: ...")
_BEFORE_CLAUSE = ("a comparison with an earlier state", re.compile(r"\bbefore\s+[^.;:()]{1,40}:", re.I))
_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?"
    r"|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
_DATES_AND_COMMITS = [
    (
        "a date",
        re.compile(
            rf"\b{_DATE}\b|\b{_MONTH}\.?\s+(?:\d{{1,2}}(?:st|nd|rd|th)?,?\s+)?\d{{4}}\b"
            rf"|\b\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH}\.?,?\s+\d{{4}}\b"
        ),
    ),
    (
        "a commit hash",
        # hex digits with a letter and a digit; not a number such as 5.8981e13 or 2e10
        re.compile(r"(?<![.\w])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)(?!\d+e\d+\b)[0-9a-f]{7,40}\b"),
    ),
]
# Documents: every rule.
_HISTORY = [_PAST_TENSE, *_COMMON_HISTORY, _BEFORE_CLAUSE]
_DOC_RULES = [*_HISTORY, *_DATES_AND_COMMITS]
# Comments and docstrings: past tense only before a figure or a verb of editing the code.
_CODE_PAST_TENSE = (
    "past tense",
    re.compile(
        r"\b(?:was|were)\s+(?:(?:changed|fixed|renamed|added|removed|moved|replaced|introduced|rewritten|dropped|"
        r"reverted|measured)\b|~?\d[\d.,]*)",
        re.I,
    ),
)
CODE_HISTORY = [_CODE_PAST_TENSE, *_COMMON_HISTORY, *_DATES_AND_COMMITS]

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


def _findings_in(lines, rules, allowed=()) -> list[tuple[int, str, str]]:
    out = []
    for number, line in lines:
        for phrase in allowed:
            line = line.replace(phrase, "")
        for rule, pattern in rules:
            for m in pattern.finditer(line):
                out.append((number, rule, m.group(0)))
    return out


def history_findings(text: str, allowed=(), dates=True) -> list[tuple[int, str, str]]:
    """(line number, rule, matched words) for each piece of history wording, date or commit hash in a
    Markdown text (`dates=False`: history wording only). A phrase of `allowed` is left out of the
    lines that contain it."""
    return _findings_in(prose_lines(text), _DOC_RULES if dates else _HISTORY, allowed)


_QUOTED = re.compile(r'"[^"]*"')


def comment_lines(source: str):
    """(line number, text) of each line of a Python module's comments and docstrings (module, class
    and function), with `inline code` and "quoted text" blanked. One pass of the tokenizer: a
    docstring is a string that opens the module or follows a `def`/`class` header's colon."""
    expect_doc, first, last = True, None, None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        kind = tok.type
        if kind == tokenize.COMMENT:
            yield tok.start[0], _blank(tok.string)
        elif kind == tokenize.STRING and expect_doc and first is None:
            for i, line in enumerate(tok.string.splitlines()):
                yield tok.start[0] + i, _blank(line)
            expect_doc = False
        elif kind == tokenize.NEWLINE:
            expect_doc = first in ("def", "class", "async") and last == ":"
            first = None
        elif kind not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING):
            if first is None:
                first = tok.string
                expect_doc = expect_doc and kind == tokenize.STRING
            last = tok.string


def _blank(text: str) -> str:
    return _QUOTED.sub('""', _INLINE_CODE.sub("``", text))


def code_findings(source: str) -> list[tuple[int, str, str]]:
    """(line number, rule, matched words) for each piece of history wording, date or commit hash in
    the comments and docstrings of a Python module's source."""
    if not any(pattern.search(source) for _, pattern in CODE_HISTORY):
        return []  # blanking code and quotes only takes words away: no match in the whole text, none in its comments
    return _findings_in(comment_lines(source), CODE_HISTORY)


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


def checked_modules() -> list[str]:
    files = []
    if CHECK_CODE:
        for root, _, names in os.walk(os.path.join(REPO, "torchtpu")):
            files += sorted(os.path.relpath(os.path.join(root, n), REPO) for n in names if n.endswith(".py"))
    return files


def _finding(name: str, number: int, rule: str, words: str) -> str:
    if rule in ("a date", "a commit hash"):
        return f"{name}:{number}: {rule}: {words!r}; git dates each line, say what is true of this commit"
    return f"{name}:{number}: history wording ({rule}): {words!r}; say what is true now"


def findings() -> list[str]:
    """Every problem in the checked documents and modules, one line each."""
    out = []
    if CHECK_README:
        n = len(open(os.path.join(REPO, "README.md"), encoding="utf-8").read().splitlines())
        if n > README_MAX_LINES:
            out.append(f"README.md: {n} lines; at most {README_MAX_LINES} (move detail to docs/<topic>.md)")
    for name in checked_files():
        text = open(os.path.join(REPO, name), encoding="utf-8").read()
        allowed = [phrase for f, phrase, _ in ALLOWED if f == name]
        out += [_finding(name, *found) for found in history_findings(text, allowed)]
    for name in checked_modules():
        source = open(os.path.join(REPO, name), encoding="utf-8").read()
        out += [_finding(name, *found) for found in code_findings(source)]
    return out


def main() -> int:
    problems = findings()
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
