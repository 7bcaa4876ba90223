"""What a training process does when something goes wrong: exit codes, preemption, the step watchdog.

Exit codes (the contract `torchtpu-launch`, torchelastic, xpk and JobSet rely on):

    EXIT_OK = 0          the job finished
    EXIT_FAILURE = 1     any other failure
    EXIT_CONFIG = 2      configuration or usage error: retrying cannot help
    EXIT_RETRIABLE = 42  preempted or stuck: restart the job, it resumes from its newest checkpoint
    EXIT_INTERRUPTED = 130  stopped by Ctrl-C (SIGINT) after checkpointing the last step finished;
                         the next start resumes there (a second Ctrl-C aborts at once, also 130)

Preemption. A SIGTERM to any process of the job (a TPU VM maintenance event, a GKE eviction,
`torchtpu-launch` being stopped) asks the job to stop at a step boundary. With several processes
they must all stop at the *same* step, because writing a checkpoint is a collective: JAX's
preemption service (started by `jax.distributed.initialize`, it owns SIGTERM in that case) spreads
the notice to every process and `reached_preemption_sync_point(step)` turns true on all of them at
one agreed step. A single process handles SIGTERM with a plain Python handler.

Ctrl-C (SIGINT) is SIGTERM's equal: the first one stops the loop at the next step boundary, after any
save in flight has finished and the step just finished is checkpointed, and the process exits 130.
A second Ctrl-C ends the process at once (also 130): a save it cuts short is ignored by the next
start, which resumes from the checkpoint before it. In a multi-process job the first SIGINT is passed
on as a SIGTERM to this process, so JAX's preemption service stops every process at one step (they
exit 42).

The step watchdog. A host whose peer died or hung blocks inside a collective forever. A thread
watches the steps the loop finishes; when none finished for `[comm] init_timeout_seconds` (start-up
and the first step, which compiles) or `[comm] train_timeout_seconds` (later steps), it writes
every Python thread's stack to stderr (the host's log) and ends the process with EXIT_RETRIABLE; in
a multi-process job it ends a few seconds after its dump (PEER_DUMP_GRACE_S), so that the stuck
host's watchdog, which fires at about the same time, writes its stacks before JAX's coordination
service aborts it.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
import threading
import time

__all__ = [
    "ATTEMPT_ENV",
    "EXIT_OK",
    "EXIT_FAILURE",
    "EXIT_CONFIG",
    "EXIT_RETRIABLE",
    "EXIT_INTERRUPTED",
    "RESTART_EXIT_CODES",
    "Preempted",
    "PreemptionWatch",
    "StepWatchdog",
    "attempt_number",
    "failure_status",
    "leave_job",
    "injected_stall",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_RETRIABLE = 42
# how long a multi-process job's host whose step watchdog fired waits before it exits (StepWatchdog)
PEER_DUMP_GRACE_S = 5.0
EXIT_INTERRUPTED = 130
# The statuses a scheduler should restart the job on (GKE's JobSet as torchtpu-launch gke renders it,
# as xpk does): 42, and 127-255, a process killed by a signal (128 + N: SIGKILL and the OOM killer
# give 137) or a command that could not be started.
RESTART_EXIT_CODES = (EXIT_RETRIABLE, *range(127, 256))


class Preempted(Exception):
    """The job was asked to stop (SIGTERM, or SIGINT: `signal`); a checkpoint of `step` has been
    written. `exit_status`: 42 for SIGTERM, 130 for SIGINT."""

    def __init__(self, step: int, checkpoint: str | None, signal_name: str = "SIGTERM"):
        self.step = step
        self.checkpoint = checkpoint
        self.exit_status = EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_RETRIABLE
        where = f"checkpoint {checkpoint} written" if checkpoint else "checkpoints are off, nothing saved"
        if self.exit_status == EXIT_RETRIABLE:
            then = f"exiting with {EXIT_RETRIABLE} (retriable), the next attempt resumes from the newest checkpoint"
        else:
            then = f"exiting with {EXIT_INTERRUPTED}; the same command resumes from the newest checkpoint"
        super().__init__(
            f"{'preempted' if signal_name == 'SIGTERM' else 'stopped'} ({signal_name}) after step {step}: {where}; {then}"
        )


# The job's attempt (1, 2, ...), the same on every host; set by torchtpu.launch.agent.
ATTEMPT_ENV = "TORCHTPU_ATTEMPT"


def attempt_number() -> int:
    """1 for a job's first attempt, n + 1 after its n-th (gang) restart."""
    if os.environ.get(ATTEMPT_ENV, "").isdigit():
        return int(os.environ[ATTEMPT_ENV])
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) + 1


def _jax_preemption_service():
    """JAX's preemption sync manager when this process is part of a jax.distributed job, else None."""
    try:
        from jax._src import distributed

        return distributed.global_state.preemption_sync_manager
    except Exception:  # noqa: BLE001  (private API moved: fall back to the Python handler)
        return None


class PreemptionWatch:
    """Tells the loop, after each step, whether the job must stop there (all processes agree).

    SIGTERM and a first SIGINT ask for the stop; a second SIGINT ends the process at once."""

    def __init__(self):
        self._flag = threading.Event()
        self.signal_name = "SIGTERM"
        self._previous: dict = {}
        self._service = _jax_preemption_service()
        if threading.current_thread() is threading.main_thread():
            if self._service is None:
                self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigterm(self, signum, frame):
        self._flag.set()

    def _on_sigint(self, signum, frame):
        # os.write, not print: the handler may run while the main thread is inside a print
        if self._flag.is_set() and self.signal_name == "SIGINT":
            os.write(2, b"\n[torchtpu-train] second Ctrl-C: stopping now, without a checkpoint of this step\n")
            os._exit(EXIT_INTERRUPTED)
        self.signal_name = "SIGINT"
        self._flag.set()
        os.write(
            2,
            b"\n[torchtpu-train] Ctrl-C: stopping after this step, once its checkpoint is written "
            b"(Ctrl-C again stops at once)\n",
        )
        if self._service is not None:
            os.kill(os.getpid(), signal.SIGTERM)  # JAX's service spreads it: every process stops at one step

    @property
    def stop_signal(self) -> str:
        """The signal the stop answers; with JAX's service every process stops as for SIGTERM."""
        return "SIGTERM" if self._service is not None else self.signal_name

    def should_stop(self, step: int) -> bool:
        if self._service is not None:
            from jax.experimental import multihost_utils

            return bool(multihost_utils.reached_preemption_sync_point(step))
        return self._flag.is_set()

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


class StepWatchdog:
    """Ends the process with EXIT_RETRIABLE (after dumping all stacks) when no step finishes in time."""

    def __init__(self, first_step_seconds: float, step_seconds: float, label: str = ""):
        self.first_step_seconds = float(first_step_seconds)
        self.step_seconds = float(step_seconds)
        self.label = label
        from ..backend.compile import BUILDS  # here, not at the top: the launcher imports this module

        self._builds = BUILDS
        self._last = time.monotonic()
        self._steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="torchtpu-step-watchdog", daemon=True)
        self._thread.start()

    def step_done(self) -> None:
        self._steps += 1
        self._last = time.monotonic()

    def _building(self) -> bool:
        return self._builds.active > 0

    def _limit(self) -> float:
        # The first step, and any step that builds a program (the compiled step after its eager
        # warm-up, a validation program, a retrace), may take as long as the first one.
        if self._steps == 0 or self._building():
            return max(self.first_step_seconds, self.step_seconds)
        return self.step_seconds

    def _waited(self) -> float:
        now = time.monotonic()
        if self._building():
            return now - max(self._last, self._builds.started)
        return now - max(self._last, self._builds.last_end)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self._limit() / 4)):
            waited = self._waited()
            if waited > self._limit():
                self._fire(waited)

    def _fire(self, waited: float) -> None:
        which = (
            "[comm] init_timeout_seconds" if self._steps == 0 or self._building() else "[comm] train_timeout_seconds"
        )
        msg = (
            f"{self.label}step watchdog: no training step finished in {waited:.0f} s (limit {self._limit():.0f} s, "
            f"{which}); a host is stuck or gone. Stacks of every thread follow; exiting with "
            f"{EXIT_RETRIABLE} (retriable)"
        )
        try:
            sys.stdout.flush()
            print(msg, file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            if _in_multiprocess_job():
                # The peers' watchdogs, on the same limit since the same step, fire within moments of
                # this one; JAX's coordination service aborts every process once this one exits. Stay
                # a little, so that the stuck host writes its own stacks (where it is stuck) too.
                time.sleep(min(PEER_DUMP_GRACE_S, self._limit() / 2))
        finally:
            os._exit(EXIT_RETRIABLE)  # a thread stuck in a collective cannot be unwound: leave now

    def close(self) -> None:
        self._stop.set()


def _in_multiprocess_job() -> bool:
    try:
        from jax._src import distributed

        return distributed.global_state.client is not None
    except Exception:  # noqa: BLE001
        return False


_GLOO_FAILED = re.compile(r"\bGloo \w+ failed: ")


def failure_status(error: BaseException) -> tuple[int, str]:
    """(exit status, explanation) for an exception that ends training.

    In a multi-process job an XLA runtime error is how a collective reports a peer that is gone
    (gloo: "Connection reset by peer"): the job is retriable, 42. So is any error carrying gloo's own
    report of a failed collective: the same failure reaches the trainer as a ValueError when the
    peer dies while the step is being traced (its second step). Anything else is 1."""
    if _in_multiprocess_job() and (
        type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError") or _GLOO_FAILED.search(str(error))
    ):
        return (
            EXIT_RETRIABLE,
            f"; a collective failed, another host is probably gone: exiting with {EXIT_RETRIABLE} (retriable)",
        )
    return EXIT_FAILURE, ""


def leave_job(status: int) -> int:
    """Return `status`; after a failure in a multi-process job, exit right away instead.

    A normal exit runs jax.distributed's shutdown, which waits (minutes) at a barrier for every
    other process; a failed job's peers may be dead, and the host must not hang."""
    if status and _in_multiprocess_job():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def injected_stall(spec: str, process_index: int):
    """[debug] inject_stall = "HOST:STEP:SECONDS" on process HOST: a function of the step number that
    sleeps SECONDS in step STEP (a stuck host); None on the other processes, or when `spec` is empty."""
    if not spec:
        return None
    host, at, seconds = spec.split(":")
    if int(host) != process_index:
        return None

    def stall(step: int) -> None:
        if step == int(at):
            print(
                f"[debug] inject_stall: process {process_index} stalls {float(seconds):.0f} s in step {step}",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(float(seconds))

    return stall
