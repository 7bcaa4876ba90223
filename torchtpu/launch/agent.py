"""One host's supervisor: torchelastic (what `torchrun` runs) around one training process per host.

    python -m torchtpu.launch.agent --nnodes N --host-index I --rdzv-endpoint HOST:PORT \\
        --run-id ID [--max-restarts R] [--log-dir DIR] -- CMD ...

Every host of a job runs this once (`torchtpu-launch local` starts N of them on this machine,
`tpu-vm` one per TPU VM worker over ssh, `gke` one per pod). torchelastic does the work:
c10d rendezvous, gang restarts (a failed training process on any host restarts the processes of
every host, up to R times) and stopping the training process when the agent is signalled. What
this module adds is what a TPU job needs on top of plain `torchrun`:

- Exit status. `torchrun` ends with 1 whatever its child did. Here the host's exit status is the
  training process's own (0 done, 42 retriable, 2 configuration error, 1 other), 128 + N when it
  died of signal N, and 42 when the host itself was told to stop (SIGTERM: the trainer has then
  checkpointed and exited 42). GKE's JobSet and xpk decide on restarts from exactly this status.
- Logs. Every line of the training process is printed with a `[host I]` prefix and kept, per
  attempt, in `DIR/attempt_<n>/host_<I>.stdout.log` / `.stderr.log`.
- A last line naming the host and what happened to its process, for the launcher and the user.
- A quiet console: c10d's C++ warnings (a rendezvous store gone at the end of a job) are kept in
  `DIR/agent_<I>.stderr.log`, not printed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from torchtpu.train.fault import ATTEMPT_ENV, EXIT_CONFIG, EXIT_FAILURE, EXIT_RETRIABLE, attempt_number

PROG = "torchtpu-launch agent"


def describe_exit(code: int) -> str:
    """'exit status 42 (retriable)', 'killed by signal 9 (SIGKILL)', ... for a process or agent status."""
    if code < 0 or code > 128:
        num = -code if code < 0 else code - 128
        try:
            name = signal.Signals(num).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {num} ({name})"
    meaning = {0: "done", 1: "failed", 2: "configuration or usage error", 42: "retriable: preempted or stuck"}
    return f"exit status {code}" + (f" ({meaning[code]})" if code in meaning else "")


def _logs_specs(log_dir: str | None, host_index: int):
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class HostLogs(LogsSpecs):
        """<log_dir>/attempt_<n>/host_<i>.{stdout,stderr}.log, also shown on the console ([host i])."""

        def __init__(self):
            super().__init__(log_dir=log_dir)

        @property
        def root_log_dir(self) -> str:
            return log_dir or os.devnull

        def reify(self, envs):
            if not log_dir:
                return LogsDest()
            attempt = attempt_number()
            folder = os.path.join(log_dir, f"attempt_{attempt}")
            os.makedirs(folder, exist_ok=True)
            stdouts, stderrs, errors = {}, {}, {}
            for local_rank in envs:
                name = f"host_{host_index}" if len(envs) == 1 else f"host_{host_index}.{local_rank}"
                stdouts[local_rank] = os.path.join(folder, f"{name}.stdout.log")
                stderrs[local_rank] = os.path.join(folder, f"{name}.stderr.log")
                errors[local_rank] = os.path.join(folder, f"{name}.error.json")
                envs[local_rank]["TORCHELASTIC_ERROR_FILE"] = errors[local_rank]
            return LogsDest(
                stdouts,
                stderrs,
                dict(stdouts),
                dict(stderrs),
                errors,
                os.path.join(folder, f"host_{host_index}.filtered_stdout.log"),
                os.path.join(folder, f"host_{host_index}.filtered_stderr.log"),
            )

    return HostLogs()


def host_index(value: str, offset: int = 0) -> int:
    """The host's index from --host-index (a number, or auto: from the environment of a TPU VM / GKE pod)."""
    if value != "auto":
        if not value.strip().isdigit():
            raise SystemExit(
                f"{PROG}: --host-index {value!r} is not a host number; pass --host-index N (0, 1, ...) or auto"
            )
        return int(value)
    for key in ("TORCHTPU_HOST_INDEX", "TPU_WORKER_ID", "JOB_COMPLETION_INDEX"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key]) + offset
    try:  # a Cloud TPU VM knows its worker number from the metadata server
        return int(_tpu_metadata("agent-worker-number")) + offset
    except Exception:  # noqa: BLE001
        raise SystemExit(
            f"{PROG}: --host-index auto: no $TORCHTPU_HOST_INDEX, $TPU_WORKER_ID or "
            "$JOB_COMPLETION_INDEX and no TPU VM metadata server; pass --host-index N"
        ) from None


def _tpu_metadata(key: str) -> str:
    import urllib.request

    req = urllib.request.Request(
        f"http://metadata.google.internal/computeMetadata/v1/instance/attributes/{key}",
        headers={"Metadata-Flavor": "Google"},
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode().strip()


def rdzv_endpoint(value: str) -> str:
    """HOST:PORT, where HOST `auto` is worker 0 of this TPU VM slice ($TORCHTPU_RDZV_HOST overrides)."""
    host, _, port = value.rpartition(":")
    if host != "auto":
        return value
    if os.environ.get("TORCHTPU_RDZV_HOST"):
        return f"{os.environ['TORCHTPU_RDZV_HOST']}:{port}"
    try:  # "<id>:<id>:<ip>,..." for the slice's workers, worker 0 first
        first = _tpu_metadata("worker-network-endpoints").split(",")[0]
        return f"{first.split(':')[2]}:{port}"
    except Exception:  # noqa: BLE001
        raise SystemExit(
            f"{PROG}: --rdzv-endpoint {value}: not on a Cloud TPU VM (no worker-network-endpoints in "
            "its metadata) and no $TORCHTPU_RDZV_HOST; pass --rdzv-endpoint HOST:PORT"
        ) from None


def resolve_command(cmd: list[str]) -> list[str]:
    """`torchtpu-train ...` runs with this Python (`-m torchtpu.train`), whatever is on PATH."""
    if cmd and cmd[0] == "torchtpu-train":
        return [sys.executable, "-m", "torchtpu.train", *cmd[1:]]
    return list(cmd)


_JOINED = [False]  # whether this agent has joined a rendezvous round


def _use_torchtpu_agent() -> None:
    """Two additions to torchelastic's LocalElasticAgent, which its launcher builds for this process:

    - Attempt numbers every host agrees on. torchelastic's TORCHELASTIC_RESTART_COUNT counts only
      the restarts a host's *own* failures cost; a host restarted because a peer re-joined keeps
      its count, so the hosts of one attempt can disagree. Every host joins every rendezvous
      round (min = max hosts), so the number of rounds joined is the same everywhere:
      TORCHTPU_ATTEMPT = that number, for the workers (keys, logs) and the log folders.
    - Exit status 2 (a configuration error fails every attempt alike) spends the remaining restarts.
    """
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api

    class Agent(LocalElasticAgent):
        _rounds = 0

        def _rendezvous(self, worker_group):
            super()._rendezvous(worker_group)
            self._rounds += 1
            _JOINED[0] = True
            os.environ[ATTEMPT_ENV] = str(self._rounds)  # inherited by the workers started next

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED and any(f.exitcode == EXIT_CONFIG for f in result.failures.values()):
                self._remaining_restarts = 0
            return result

    api.LocalElasticAgent = Agent


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description="One host of a torchtpu job under torchelastic.")
    p.add_argument("--nnodes", type=int, required=True, help="hosts in the job")
    p.add_argument(
        "--host-index",
        default="auto",
        help="this host's index (logs, messages; host 0 serves the rendezvous). auto: "
        "$TORCHTPU_HOST_INDEX, $TPU_WORKER_ID, $JOB_COMPLETION_INDEX or the TPU VM's worker number",
    )
    p.add_argument(
        "--host-offset",
        type=int,
        default=0,
        help="added to an auto host index (slice number x hosts per slice, for multislice)",
    )
    p.add_argument("--rdzv-endpoint", required=True, help="HOST:PORT of the rendezvous (host 0's address)")
    p.add_argument("--run-id", required=True, help="the job's id (the same on every host)")
    p.add_argument("--max-restarts", type=int, default=0, help="gang restarts allowed (default 0)")
    p.add_argument("--log-dir", default=None, help="per-attempt log folder (default: console only)")
    p.add_argument("--monitor-interval", type=float, default=0.5, help="seconds between health checks")
    p.add_argument(
        "--shutdown-timeout",
        type=int,
        default=120,
        help="seconds a stopped training process gets to checkpoint before SIGKILL (default 120)",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the training command")
    args = p.parse_args(argv)
    if args.cmd and args.cmd[0] == "--":
        args.cmd = args.cmd[1:]
    if not args.cmd:
        p.error("no command: give it after --, e.g. -- torchtpu-train --config train_configs/debug_model.toml")
    return args


def _filter_stderr(log_dir: str | None, host: int) -> None:
    """Send this agent's stderr through torchtpu/train/console_filter.py --c10d-only: c10d's C++
    TCPStore warnings and their stack frames stay off the console (host 0 serves the rendezvous store,
    and an agent still closing the rendezvous when it has gone prints them at the end of a job). The
    whole stderr is kept in LOG_DIR/agent_<host>.stderr.log when there is a log folder."""
    import subprocess

    from torchtpu.train import console_filter

    log = os.devnull
    if log_dir:
        try:
            os.makedirs(log_dir, exist_ok=True)
            log = os.path.join(log_dir, f"agent_{host}.stderr.log")
        except OSError:
            pass
    sys.stderr.flush()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", console_filter.__file__, "--c10d-only", log],
            stdin=subprocess.PIPE,
            stdout=sys.stderr.fileno(),
        )
    except OSError:
        return
    os.dup2(proc.stdin.fileno(), sys.stderr.fileno())  # EOF once this agent and its children are gone
    proc.stdin.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    host = host_index(args.host_index, args.host_offset)
    _filter_stderr(args.log_dir, host)
    config = LaunchConfig(
        min_nodes=args.nnodes,
        max_nodes=args.nnodes,
        nproc_per_node=1,
        run_id=args.run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=rdzv_endpoint(args.rdzv_endpoint),
        # Host 0 serves the rendezvous store; the others only connect to it.
        rdzv_configs={"is_host": host == 0, "timeout": 600},
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        logs_specs=_logs_specs(args.log_dir, host),
        log_line_prefix_template=f"[host {host}] ",
        shutdown_timeout=args.shutdown_timeout,
    )
    os.environ["TORCHTPU_HOST_INDEX"] = str(host)
    _use_torchtpu_agent()
    cmd = resolve_command(args.cmd)
    try:
        elastic_launch(config, cmd[0])(*cmd[1:])
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        code = failure.exitcode
        status = 128 - code if code < 0 else code
        print(
            f"{PROG}: host {host}: the training process ended with {describe_exit(code)}", file=sys.stderr, flush=True
        )
        return status if status else EXIT_FAILURE
    except SignalException as e:
        # torchelastic has passed the signal on and waited for the training process, which
        # checkpoints and exits 42 on SIGTERM.
        print(
            f"{PROG}: host {host}: stopped by {e.sigval.name}; the training process was asked to checkpoint "
            f"and exit; exit status {EXIT_RETRIABLE} (retriable)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_RETRIABLE
    except RendezvousConnectionError:
        endpoint = config.rdzv_endpoint
        if not _JOINED[0]:
            print(f"{PROG}: host {host}: cannot reach the rendezvous at {endpoint}", file=sys.stderr, flush=True)
            return EXIT_FAILURE
        # Host 0's agent serves the store and leaves when its training process has ended (no restarts
        # left): the job is over, decided there. This host's process was stopped by torchelastic; its
        # status must not read as a failure of its own, which would end a JobSet that host 0's 42 restarts.
        print(
            f"{PROG}: host {host}: the rendezvous at {endpoint} has gone (host 0's agent ended, or the network to "
            f"it failed); the training process was stopped; exit status {EXIT_RETRIABLE} (retriable)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_RETRIABLE
    return 0


if __name__ == "__main__":
    sys.exit(main())
