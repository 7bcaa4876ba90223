"""One job per dump folder: an exclusive lock file, `<dump_folder>/torchtpu.lock`.

    lock = hold_dump_folder(cfg)                 # raises ConfigError (exit 2) when a live job holds it
    ...                                          # the whole run; a thread refreshes the heartbeat
    lock.release()

Two trainers writing one folder interleave metrics.jsonl and break each other's checkpoints, so the
second one must refuse to start. The lock is a file created with O_CREAT | O_EXCL, which is atomic on
a local disk and on NFSv3+ (Filestore): of two hosts creating it at once exactly one succeeds. fcntl
locks are not used: NFS implements them through a separate lock daemon and FUSE file systems (GCS
FUSE among them) mostly ignore them. The file holds JSON naming its job (`job`), host, pid, the
process's start time and its kernel start ticks, and the owner refreshes its modification time every
HEARTBEAT_SECONDS.

Every process of one job may hold the lock together: a job launched by torchelastic
(`torchtpu-launch`, torchrun) is named by its `TORCHELASTIC_RUN_ID`, the same on every host and on
every restart of the job, so the hosts of a job, and its next attempt, join the lock instead of being
refused (a restarted host whose predecessor created the file takes it over as for a stale lock).
Without a run id the job is this one process.

A lock whose holder is gone is stale and the next start takes it over:

* written on this host: its pid runs no process, or a process with other start ticks (a
  recycled pid);
* written on another host: its heartbeat is older than STALE_SECONDS. Ages are measured against
  the folder's own clock (the modification time of a file written just now), so hosts whose clocks
  differ still agree;
* unreadable (empty or cut short: its creator died between creating and writing it) and unchanged
  for STALE_SECONDS. A younger unreadable file is one in writing: a start waits for it (up to
  ACQUIRE_SECONDS), which matters when the hosts of one job start together on a slow machine.

Taking over is itself serialized by a second O_EXCL file (`torchtpu.lock.takeover`), so of two
starters that both found the lock stale only one replaces it, and the other then finds a live lock.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time

from .config.job_config import ConfigError

__all__ = [
    "LOCK_NAME",
    "RUN_ID_ENV",
    "HEARTBEAT_SECONDS",
    "STALE_SECONDS",
    "ACQUIRE_SECONDS",
    "DumpFolderLock",
    "hold_dump_folder",
]

LOCK_NAME = "torchtpu.lock"
HEARTBEAT_SECONDS = 10.0
STALE_SECONDS = 60.0
ACQUIRE_SECONDS = 30.0  # how long a start keeps trying while the lock file is in writing or being replaced
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"


def _start_ticks(pid: int) -> str | None:
    """The kernel's start time of process `pid` (field 22 of /proc/PID/stat), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()[19]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def _folder_now(folder: str) -> float:
    """The folder's file system clock: the modification time of a file written now."""
    probe = os.path.join(folder, f".{LOCK_NAME}.clock-{socket.gethostname()}-{os.getpid()}")
    try:
        with open(probe, "w", encoding="utf-8"):
            pass
        return os.stat(probe).st_mtime
    except OSError:
        return time.time()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)


def _age(path: str, mtime: float) -> float:
    """Seconds since `mtime` (a modification time of a file in `path`'s folder) by the folder's clock."""
    return _folder_now(os.path.dirname(path)) - mtime


def _describe(holder: dict) -> str:
    started = holder.get("started", "?")
    return f"job {holder.get('job', '?')} (host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {started})"


class DumpFolderLock:
    """This job's hold on a dump folder; see the module docstring."""

    def __init__(self, path: str, record: dict, owner: bool):
        self.path = path
        self.record = record
        self.owner = owner  # this process created the file (it removes it on release)
        self.took_over: dict | None = None  # the stale holder replaced, if any
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="torchtpu-dump-lock", daemon=True)

    # -- acquiring -----------------------------------------------------------------------------

    @classmethod
    def acquire(cls, folder: str, job: str | None = None) -> DumpFolderLock:
        """Hold `folder` for this job or raise ConfigError naming the job that holds it.

        `job`: the job's name, shared by all its processes (default: $TORCHELASTIC_RUN_ID, else this
        process alone)."""
        folder = os.path.abspath(folder)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"[job] dump_folder = {folder!r} cannot be created: {e.strerror}; choose another "
                "--job.dump_folder or make it writable"
            ) from None
        host, pid = socket.gethostname(), os.getpid()
        record = {
            "job": job or os.environ.get(RUN_ID_ENV) or f"{host}:{pid}",
            "host": host,
            "pid": pid,
            "pid_start": _start_ticks(pid),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        path = os.path.join(folder, LOCK_NAME)
        took_over = None
        deadline = time.monotonic() + ACQUIRE_SECONDS
        while True:
            if cls._create(path, record):
                lock = cls(path, record, owner=True)
                lock.took_over = took_over
                return lock._start()
            holder = cls._read(path)
            if holder is None:
                # removed between our attempt and the read, or created and not yet written (its creator
                # writes it right away), or left empty by a creator that died in between: stale once old
                why = cls._unreadable_stale_reason(path)
                if why is not None and cls._replace_stale(path, None):
                    took_over = {"job": "unknown (unreadable lock file)", "why": why}
            else:
                if holder.get("host") == host and holder.get("pid") == pid:
                    return cls(path, holder, owner=True)._start()  # ours, from before this process re-executed itself
                why = cls._stale_reason(path, holder)
                if why is None and holder.get("job") == record["job"]:
                    return cls(path, holder, owner=False)._start()  # another live process of this job holds it
                if why is None:
                    raise ConfigError(cls._busy_message(path, holder))
                if cls._replace_stale(path, holder):
                    took_over = dict(holder, why=why)
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"{path}: could not take the dump folder's lock in {ACQUIRE_SECONDS:.0f} s: "
                    + (
                        "the file stays unreadable (a job still writing it, or a broken file system); remove it "
                        "if no job uses this folder, or give this run another --job.dump_folder"
                        if holder is None
                        else "other jobs keep replacing it; give this run another --job.dump_folder"
                    )
                )
            time.sleep(0.05)

    @staticmethod
    def _create(path: str, record: dict) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            raise ConfigError(
                f"[job] dump_folder = {os.path.dirname(path)!r} is not writable: {e.strerror}; choose another "
                "--job.dump_folder or make it writable"
            ) from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    @staticmethod
    def _read(path: str) -> dict | None:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            data["_mtime"] = os.stat(path).st_mtime
            return data
        except (OSError, ValueError):
            return None

    @staticmethod
    def _stale_reason(path: str, holder: dict) -> str | None:
        """Why `holder` has lost the lock, or None while it holds it."""
        if holder.get("host") == socket.gethostname():
            pid = int(holder.get("pid", -1))
            if not _pid_alive(pid):
                return f"pid {pid} is not running"
            ticks = _start_ticks(pid)
            if holder.get("pid_start") and ticks and ticks != holder["pid_start"]:
                return f"pid {pid} is now another process"
            return None
        age = _age(path, holder["_mtime"])
        if age > STALE_SECONDS:
            return f"no heartbeat for {age:.0f} s"
        return None

    @staticmethod
    def _unreadable_stale_reason(path: str) -> str | None:
        """Why an unreadable lock file is stale (unchanged for STALE_SECONDS), or None: it may be in writing,
        or gone."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        age = _age(path, st.st_mtime)
        if age > STALE_SECONDS:
            return f"its lock file is unreadable ({st.st_size} bytes) and unchanged for {age:.0f} s"
        return None

    @classmethod
    def _replace_stale(cls, path: str, holder: dict | None) -> bool:
        """Remove the stale lock `holder` (None: an unreadable one), unless someone else is replacing it now."""
        guard = path + ".takeover"
        try:
            fd = os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            with contextlib.suppress(OSError):  # a takeover that died half way: clear its guard
                if _age(guard, os.stat(guard).st_mtime) > STALE_SECONDS:
                    os.unlink(guard)
            return False
        os.close(fd)
        try:
            now = cls._read(path)
            # still the same stale holder (nobody took it over meanwhile): remove it
            if holder is None:
                same = now is None and cls._unreadable_stale_reason(path) is not None
            else:
                same = now is not None and all(now.get(k) == holder.get(k) for k in ("job", "host", "pid", "started"))
            if same:
                os.unlink(path)
                return True
            return False
        finally:
            with contextlib.suppress(OSError):
                os.unlink(guard)

    @staticmethod
    def _busy_message(path: str, holder: dict) -> str:
        folder = os.path.dirname(path)
        age = max(0.0, _age(path, holder["_mtime"]))
        same_host = holder.get("host") == socket.gethostname()
        stop = f"stop it (kill {holder.get('pid')}" + ("" if same_host else f" on {holder.get('host')}") + ")"
        return (
            f"the dump folder {folder} is in use by {_describe(holder)}, heartbeat {age:.0f} s ago. "
            f"Wait for that job to end, {stop}, or give this run another --job.dump_folder. "
            f"If that job is gone, its lock {path} is taken over by the next start"
            + ("" if same_host else f" {STALE_SECONDS:.0f} s after its last heartbeat")
        )

    # -- holding ---------------------------------------------------------------------------------

    def _start(self) -> DumpFolderLock:
        self._thread.start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            now = self._read(self.path)
            if now is not None and now.get("job") == self.record["job"]:
                with contextlib.suppress(OSError):
                    os.utime(self.path)

    def describe_takeover(self) -> str | None:
        """A line for the log when this start replaced a stale lock, else None."""
        if self.took_over is None:
            return None
        return f"took over the dump folder's stale lock {self.path} of {_describe(self.took_over)}: {self.took_over['why']}"

    def release(self) -> None:
        """Stop the heartbeat; the process that created the lock file removes it."""
        self._stop.set()
        if not self.owner:
            return
        now = self._read(self.path)
        if now is not None and now.get("pid") == self.record["pid"] and now.get("host") == self.record["host"]:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


_HELD: dict[str, DumpFolderLock] = {}


def hold_dump_folder(cfg) -> DumpFolderLock:
    """This process's hold on `[job] dump_folder` (taken once: later calls return the same lock until it
    is released). A takeover of a stale lock is reported on stdout."""
    folder = os.path.abspath(cfg.job.dump_folder)
    lock = _HELD.get(folder)
    if lock is None or lock._stop.is_set():
        lock = _HELD[folder] = DumpFolderLock.acquire(folder)
        if lock.describe_takeover():
            print(f"[torchtpu-train] {lock.describe_takeover()}", flush=True)
    return lock
