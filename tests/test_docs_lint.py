"""The documents' lint (tests/docs_lint.py): what its history rule flags and what it leaves, and the
documents it is switched on for pass it."""

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


def test_the_checked_documents_pass(monkeypatch):
    assert docs_lint.findings() == []
    # the README switch: on, it holds README.md to its length and wording
    monkeypatch.setattr(docs_lint, "CHECK_README", True)
    monkeypatch.setattr(docs_lint, "README_MAX_LINES", 10)
    assert any(f.startswith("README.md: ") and "at most 10" in f for f in docs_lint.findings())
