"""The documents' lint (tests/docs_lint.py): what its history, date and commit-hash rules flag and what
they leave, in documents and in the code's comments and docstrings, and that the checked files pass."""

from __future__ import annotations

import pytest

from tests import docs_lint

FLAGGED = [
    ("HBM per chip was 31.00 GiB.", "was"),
    ("Both runs were slower.", "were"),
    ("Measured in the fourth session.", "session"),
    ("Until 2026-12-01 the chunks ran under recomputation.", "Until 2026-12-01"),
    ("It stays replicated until it is fixed.", "until it is fixed"),
    ("The same as before.", "as before"),
    ("compile 70 s (before: 318 s)", "before:"),
    ("Before, it ran without loss_parallel.", "Before,"),
    ("HBM 40.85 GiB before the change.", "before the change"),
    ("the figure before 1fe91ec", "before 1fe91ec"),
    ("Eager dispatch overhead (issue 2)", "issue 2"),
    ("It no longer gathers the table.", "no longer"),
    ("The dry run previously compiled three programs.", "previously"),
    ("figures before the int32/real-RoPE change", "before the int32/real-RoPE change"),
    ("compile 90 s (before stacked storage: 319 s)", "before stacked storage:"),
    ("24.71 GiB, fits (31.00 before the table mode)", "00 before"),
    ("the 1-sequence row is from a run before that change", "before that change"),
    ("until the bench costed both programs", "until the bench costed"),
]

KEPT = [
    "The narrowing must happen on the device before the call.",
    "Check the fit before paying for chips.",
    "The saved logits stay alive until the gradient reaches the output projection.",
    "The process waits until the checkpoint is saved.",
    "Gradients are cast to reduce_dtype before the reduction.",
    "A collective may start once the one before it has started.",
    "Upstream: pytorch/pytorch#161129.",
    "The launcher prints `job failed: the save was interrupted`.",
    "```\nthe job was killed\n```",
]


DATED = [
    ("| 64.4 vs 11.7 µs | 2026-11-29 | `bench.eager_overhead` |", "2026-11-29"),
    ("Measured in Dec 2026.", "Dec 2026"),
    ("figures of December 6, 2026", "December 6, 2026"),
    ("the dry run of 6 Dec 2026", "6 Dec 2026"),
    ("HBM 27.99 GiB (at commit 8cdf04b)", "8cdf04b"),
    ("the same step (b467e26: 4476 ms)", "b467e26"),
    ("a full hash 1fe91ec2a7d3b0c4e5f6a7b8c9d0e1f2a3b4c5d6", "1fe91ec2a7d3b0c4e5f6a7b8c9d0e1f2a3b4c5d6"),
]

UNDATED = [
    "XLA FLOPs 5.8981e13 vs 5.8968e13 per chip",
    "6.9e10 against 8.6e9 FLOPs; 2e10 bytes",
    "`libtpu==0.0.42.*` with torch 2.13.0 on v5p:2x2x1 and v6e:16x16",
    "`git log 8cdf04b` and `--since 2026-12-01` are commands",
    "the 2,048-token context at 8192 positions; 1,370 tokens/s per chip in 2026 words",
    "bf16 and fp32 weights, a deadbeef marker, the cafe",
]


@pytest.mark.parametrize("text,words", DATED)
def test_dates_and_commit_hashes_are_flagged(text, words):
    found = docs_lint.history_findings(text)
    assert [w for _, rule, w in found if rule in ("a date", "a commit hash")] == [words], found
    # without the date rules (README's switch off) the same text has no finding
    assert docs_lint.history_findings(text, dates=False) == []


@pytest.mark.parametrize("text", UNDATED)
def test_numbers_versions_and_commands_are_not_dates_or_commits(text):
    assert docs_lint.history_findings(text) == []


CODE_FLAGGED = [
    ("x = 1  # the peak was 31.0 GiB here", "was 31.0"),
    ("# this helper was renamed from gather_all", "was renamed"),
    ("# it previously gathered the table", "previously"),
    ("# measured in the fourth session", "session"),
    ("# the same layout as before", "as before"),
    ("# the plan gathers no weight (at commit 8cdf04b)", "8cdf04b"),
    ("# figures of 2026-12-06", "2026-12-06"),
    ("# see issue 53", "issue 53"),
    ('def f():\n    """Gather the table.\n\n    It no longer copies the rows."""', "no longer"),
    ('"""A module.\n\nUntil 2026-12-01 the chunks ran under recomputation."""', "Until 2026-12-01"),
]

CODE_KEPT = [
    "# the tensor's storage version it was read at",
    "# peak was reset (None: never reset) and the largest reading taken since",
    "# k, v were repeated for a head split: fold each repeat's gradient back",
    "# give each process its own chip before libtpu starts: libtpu's per-process chip",
    '# "overriding a previously registered kernel": the point',
    "# checked before the step; `was 31` is code",
    'def f():\n    """Checkpoint the step and say what was written."""',
    'x = "a string that was 31 GiB in 2026-12-06 is data, not a comment"',
]


@pytest.mark.parametrize("source,words", CODE_FLAGGED)
def test_history_in_comments_and_docstrings_is_flagged(source, words):
    found = docs_lint.code_findings(source)
    assert words in [w for _, _, w in found] and all(w in source for _, _, w in found), found


@pytest.mark.parametrize("source", CODE_KEPT)
def test_run_time_past_tense_and_quotes_in_code_are_left_alone(source):
    assert docs_lint.code_findings(source) == []


def test_a_comment_finding_names_its_line():
    source = 'import os\n\n\ndef f():\n    """One line.\n\n    Formerly two."""\n    return os.sep  # ok\n'
    assert [(n, w) for n, _, w in docs_lint.code_findings(source)] == [(7, "Formerly")]


@pytest.mark.parametrize("text,words", FLAGGED)
def test_history_wording_is_flagged(text, words):
    found = docs_lint.history_findings(text)
    # the rule matches where its pattern starts, so the words reported may begin before `words`
    assert found and all(w in text for _, _, w in found), found
    assert any(set(w.split()) & set(words.split()) for _, _, w in found), (found, words)


@pytest.mark.parametrize("text", KEPT)
def test_present_tense_and_code_are_left_alone(text):
    assert docs_lint.history_findings(text) == []


def test_an_allowed_phrase_is_left_out_of_its_line():
    text = "one line\nthe knob was renamed upstream, and the run was slow"
    assert [w for _, _, w in docs_lint.history_findings(text)] == ["was", "was"]
    found = docs_lint.history_findings(text, allowed=["the knob was renamed upstream"])
    assert [(n, w) for n, _, w in found] == [(2, "was")]


def test_the_checked_documents_and_modules_pass():
    assert "torchtpu/backend/compile.py" in docs_lint.checked_modules()
    assert docs_lint.findings() == []


def test_the_readme_switch_holds_readme_to_its_length(monkeypatch):
    for switch in ("CHECK_BENCHMARKS", "CHECK_DOCS", "CHECK_CODE"):
        monkeypatch.setattr(docs_lint, switch, False)
    monkeypatch.setattr(docs_lint, "CHECK_README", True)
    monkeypatch.setattr(docs_lint, "README_MAX_LINES", 10)
    assert any(f.startswith("README.md: ") and "at most 10" in f for f in docs_lint.findings())
