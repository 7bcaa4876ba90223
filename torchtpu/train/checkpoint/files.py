"""The layout of a checkpoint folder and the checks on it: which entries are checkpoints
(`step_<N>`), saves that never finished, step folders this code did not write, setting an
unreadable checkpoint aside, and the errors that name a damaged checkpoint.

    <folder>/step_<N>/arrays      every array of the state (Orbax)
    <folder>/step_<N>/manifest    the state's structure and Python values (JSON; checkpoint_manifest.py)
    <folder>/step_<N>.orbax-checkpoint-tmp-...   a save in progress, or one that never finished
    <folder>/step_<N>.unreadable  a damaged checkpoint set aside (never deleted)
"""

from __future__ import annotations

import os
import re

__all__ = ["CheckpointError", "CorruptCheckpointError", "split_step_path"]

STEP_PREFIX = "step"
STEP_DIR = re.compile(r"^step_(\d+)$")
# Orbax's temporary directory for a save in progress: step_<N>.orbax-checkpoint-tmp-<id>
_PARTIAL_DIR = re.compile(r"^step_(\d+)\.orbax-checkpoint-tmp")
_SET_ASIDE = ".unreadable"
ARRAYS = "arrays"
MANIFEST = "manifest"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the path, key and fix."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files cannot be read back (truncated, damaged, or partly deleted); `.path` is
    its step folder. Unlike a checkpoint written for another model, an older one may still be good."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


def find_partial_saves(folder: str) -> list[str]:
    """Saves that never finished (a process killed mid-save): Orbax's temporary step folders."""
    if not os.path.isdir(folder):
        return []
    return [
        os.path.join(folder, e)
        for e in sorted(os.listdir(folder))
        if _PARTIAL_DIR.match(e) and os.path.isdir(os.path.join(folder, e))
    ]


def check_folder(folder: str) -> None:
    """Refuse a checkpoint folder that is a file, or that holds step folders this code did not write."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CheckpointError(
            f"checkpoint folder {folder} is a file, not a directory; choose another checkpoint folder"
        )
    if not os.path.isdir(folder):
        return
    for entry in sorted(os.listdir(folder)):
        full = os.path.join(folder, entry)
        if STEP_DIR.match(entry) and os.path.isdir(full) and not os.path.isdir(os.path.join(full, MANIFEST)):
            raise CheckpointError(
                f"checkpoint folder {folder} holds {entry}, which torchtpu did not write; it will not be "
                "overwritten or deleted: choose another checkpoint folder (or move that directory away)"
            )


def aside_path(step_path: str) -> str:
    """Where set_aside moves a step folder: step_<N>.unreadable, or step_<N>.unreadable-<k> if taken."""
    dst, k = step_path + _SET_ASIDE, 1
    while os.path.exists(dst):
        dst, k = f"{step_path}{_SET_ASIDE}-{k}", k + 1
    return dst


def split_step_path(path: str) -> tuple[str, int | None]:
    """A checkpoint folder, or one of its step_N folders, as (folder, N or None)."""
    path = os.path.abspath(os.path.expanduser(str(path))).rstrip(os.sep)
    m = STEP_DIR.match(os.path.basename(path))
    return (os.path.dirname(path), int(m.group(1))) if m else (path, None)


def first_line(e: BaseException, limit: int = 500) -> str:
    text = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {text[0] if text else ''}"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def save_error(path: str, e: BaseException) -> CheckpointError:
    """The error for a save of checkpoint `path` that failed with `e`: the cause, then what to do."""
    text = str(e)
    folder = os.path.dirname(path)
    if "No space left on device" in text or "os_error_code='28'" in text:
        return CheckpointError(
            f"saving checkpoint {path} failed: the disk is full (No space left on device); the checkpoints "
            f"before it are intact. Free space where {folder} lives, lower [checkpoint] keep_latest_k, or give "
            "the job another --job.dump_folder, then start it again to resume"
        )
    if "Permission denied" in text or "Read-only file system" in text:
        cause = "Read-only file system" if "Read-only" in text else "Permission denied"
        return CheckpointError(
            f"saving checkpoint {path} failed: {cause}; make {folder} writable or give the job another "
            "--job.dump_folder"
        )
    return CheckpointError(
        f"saving checkpoint {path} failed: {first_line(e)}; check free disk space and write permission for "
        "the checkpoint folder"
    )


def corrupt_error(path, key, e, steps, step) -> CheckpointError:
    older = [s for s in steps if s < step]
    fix = (
        f"restore an earlier step (restore(step={older[-1]})) or delete {path}"
        if older
        else f"delete {path} and start without resuming"
    )
    return CorruptCheckpointError(
        f"checkpoint {path} is unreadable at key {key}: it is corrupt or incomplete; {fix} (cause: {first_line(e, 240)})",
        path,
    )


def folder_size(path: str) -> int:
    """Bytes in the files under `path` (0 when it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed while walking
    return total


def describe_size(nbytes: int) -> str:
    """'74.1 MB', '3.20 GB', ... (decimal units, as `du --si` and cloud storage bills count)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{2 if unit == 'GB' else 1}f} {unit}"
    return f"{nbytes} B"
