"""`torchtpu-launch local`: a pod's structure on one machine, N hosts of K XLA CPU devices each.

Each "host" is a torchelastic agent (torchtpu.launch.agent) with its own XLA_FLAGS device count;
they meet in a c10d rendezvous on 127.0.0.1, and their training processes form one
jax.distributed job of N x K devices. This is the same arrangement `tpu-vm` makes with one agent
per TPU VM worker, so failure handling, restarts and preemption are tested here for real.

This module only starts the agents and reports: restarts are torchelastic's. Its duties are the
ones a cluster has and one machine lacks: a host whose agent exits makes the launcher stop the
others (after a grace period for them to notice on their own), a SIGTERM/SIGINT to the launcher
goes to every host, and when it returns no process of the job is left (the launcher is a child
subreaper, so processes orphaned by a dead agent are still found and killed).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

from torchtpu.train.fault import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, EXIT_RETRIABLE

from .agent import describe_exit

PROG = "torchtpu-launch local"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_env(base: dict[str, str], devices_per_host: int, host_index: int) -> dict[str, str]:
    """The environment of one local host: K XLA CPU devices (other XLA flags kept)."""
    env = dict(base)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_host}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["TORCHTPU_HOST_INDEX"] = str(host_index)
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the console (and the launcher's reader) as they are written
    return env


def agent_command(
    num_hosts: int,
    host_index: int,
    rdzv_endpoint: str,
    run_id: str,
    max_restarts: int,
    log_dir: str | None,
    cmd: list[str],
    python: str = sys.executable,
    shutdown_timeout: int | None = None,
) -> list[str]:
    """The command line of one host's agent."""
    out = [
        python,
        "-m",
        "torchtpu.launch.agent",
        "--nnodes",
        str(num_hosts),
        "--host-index",
        str(host_index),
        "--rdzv-endpoint",
        rdzv_endpoint,
        "--run-id",
        run_id,
        "--max-restarts",
        str(max_restarts),
    ]
    if log_dir:
        out += ["--log-dir", log_dir]
    if shutdown_timeout is not None:
        out += ["--shutdown-timeout", str(shutdown_timeout)]
    return out + ["--", *cmd]


def _set_child_subreaper() -> bool:
    """Orphaned descendants (a training process whose agent died) become our children, not init's."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _processes():
    """(pid, state, parent pid) of every process, read from /proc (vanished ones skipped)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state, ppid, ...
        yield int(entry), fields[0], int(fields[1])


def _descendants(root: int) -> list[int]:
    """Every live process below `root` (read from /proc)."""
    parents: dict[int, list[int]] = {}
    for pid, state, ppid in _processes():
        if state != "Z":
            parents.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _reap() -> None:
    """Collect exit statuses of adopted orphans (zombies) so they do not linger."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _kill_all(sig: int) -> None:
    for pid in _descendants(os.getpid()):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def dry_run_lines(num_hosts: int, devices_per_host: int, cmd: list[str], max_restarts: int, log_dir, shutdown_timeout):
    """What `torchtpu-launch local --dry-run` prints: each host's environment changes and agent command
    (the rendezvous port and run id are chosen when the job really starts)."""
    import shlex

    lines = []
    for i in range(num_hosts):
        env = host_env({}, devices_per_host, i)
        argv = agent_command(
            num_hosts, i, "127.0.0.1:PORT", "RUN_ID", max_restarts, log_dir, cmd, shutdown_timeout=shutdown_timeout
        )
        settings = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
        lines.append(f"# host {i}\n{settings} {shlex.join(argv)}")
    return lines


def run_local(
    num_hosts: int,
    devices_per_host: int,
    cmd: list[str],
    max_restarts: int = 0,
    log_dir: str | None = None,
    grace_seconds: float = 10.0,
    shutdown_timeout: int = 120,
) -> int:
    """Run `cmd` as a job of `num_hosts` local hosts; returns the launcher's exit status."""
    _set_child_subreaper()
    run_id = uuid.uuid4().hex[:12]
    endpoint = f"127.0.0.1:{_free_port()}"
    print(
        f"{PROG}: {num_hosts} host(s) x {devices_per_host} XLA CPU device(s), rendezvous {endpoint}, run {run_id}, "
        f"max restarts {max_restarts}" + (f", logs in {log_dir}/attempt_<n>/" if log_dir else ""),
        flush=True,
    )
    stop = {"signal": None}

    def on_signal(signum, frame):
        if stop["signal"] is None:
            stop["signal"] = signum
            print(
                f"{PROG}: {signal.Signals(signum).name} received: asking every host to checkpoint and stop",
                file=sys.stderr,
                flush=True,
            )
            for a in agents:
                if a.poll() is None:
                    a.send_signal(signal.SIGTERM)

    agents: list[subprocess.Popen] = []
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    status = EXIT_FAILURE
    try:
        for i in range(num_hosts):
            agents.append(
                subprocess.Popen(
                    agent_command(
                        num_hosts, i, endpoint, run_id, max_restarts, log_dir, cmd, shutdown_timeout=shutdown_timeout
                    ),
                    env=host_env(os.environ, devices_per_host, i),
                    start_new_session=True,
                )
            )
        first_failure = None  # (host, status)
        failures = []  # (host, status, time seen) of hosts that ended on their own with a failure, in order
        killed = set()  # hosts this launcher killed after the grace period
        deadline = None
        while True:
            _reap_orphans_only(agents)
            codes = [a.poll() for a in agents]
            seen = time.monotonic()
            for i, c in enumerate(codes):
                if c not in (None, 0) and i not in killed and all(h != i for h, _, _ in failures):
                    failures.append((i, c, seen))
                if c not in (None, 0) and first_failure is None:
                    first_failure = (i, c)
                    if stop["signal"] is None:
                        print(
                            f"{PROG}: host {i} failed ({describe_exit(c)}); stopping the other hosts "
                            f"(at most {grace_seconds:.0f} s)",
                            file=sys.stderr,
                            flush=True,
                        )
                    deadline = time.monotonic() + grace_seconds
            if all(c is not None for c in codes):
                break
            if stop["signal"] is not None and deadline is None:
                deadline = time.monotonic() + shutdown_timeout + grace_seconds
            if deadline is not None and time.monotonic() > deadline:
                print(
                    f"{PROG}: hosts {[i for i, c in enumerate(codes) if c is None]} still running after the grace "
                    "period: killing them",
                    file=sys.stderr,
                    flush=True,
                )
                for i, a in enumerate(agents):
                    if a.poll() is None:
                        killed.add(i)
                        a.kill()
            time.sleep(0.2)
        if first_failure is None:
            status = EXIT_OK
            print(f"{PROG}: all {num_hosts} hosts done", flush=True)
        else:
            host, code = _cause(failures) if failures else first_failure
            if stop["signal"] is not None:
                status = EXIT_RETRIABLE
            elif code in (EXIT_RETRIABLE, EXIT_CONFIG):
                status = code
            else:
                status = EXIT_FAILURE
            print(
                f"{PROG}: job failed: host {host} {describe_exit(code)}; exit status {status}",
                file=sys.stderr,
                flush=True,
            )
        return status
    finally:
        # No process of the job outlives the launcher.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not _descendants(os.getpid()):
                break
            _kill_all(sig)
            end = time.monotonic() + 5
            while _descendants(os.getpid()) and time.monotonic() < end:
                _reap()
                time.sleep(0.1)
        _reap()
        for s, h in previous.items():
            signal.signal(s, h)


_ABORTED = 128 + signal.SIGABRT  # an agent's status for a training process that died of SIGABRT
# JAX's coordination service aborts the surviving processes within about a second of a peer's exit, and
# each agent notices its process's end up to one monitor interval late, so a SIGABRT and an exit 42 seen
# this close together are one event seen twice.
_CONSEQUENCE_WINDOW_S = 5.0


def _cause(failures: list[tuple[int, int, float]]) -> tuple[int, int]:
    """The (host, status) whose failure ended the job, from (host, status, time seen) in the order seen.
    The hosts that notice a dead peer (a collective fails) exit 42, and one of them may end before the
    dead host's agent does, so a host that died otherwise (a signal, exit 1 or 2) is the cause ahead of
    any 42; among equals, the first seen. One exception: a SIGABRT seen within a few seconds of a 42, on
    either side, is a consequence, not a cause: when a process exits (its step watchdog's 42), JAX's
    coordination service aborts every other process at once, and which agent reports first is chance. A
    process that aborts on its own is seen long before its stalled peers' watchdogs end them with 42."""
    retriable = [t for _, c, t in failures if c == EXIT_RETRIABLE]

    def is_cause(c, t):
        if c == EXIT_RETRIABLE:
            return False
        aborted = c in (_ABORTED, -signal.SIGABRT)
        return not (aborted and any(abs(t - r) <= _CONSEQUENCE_WINDOW_S for r in retriable))

    causes = [f for f in failures if is_cause(f[1], f[2])]
    firsts = causes or [f for f in failures if f[1] == EXIT_RETRIABLE] or failures
    return firsts[0][0], firsts[0][1]


def _reap_orphans_only(agents: list[subprocess.Popen]) -> None:
    """Reap adopted orphans without stealing the agents' exit statuses from Popen."""
    ours = {a.pid for a in agents}
    for pid, state, ppid in _processes():
        if pid not in ours and state == "Z" and ppid == os.getpid():
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
