"""`torchtpu-launch`: argument parsing for the subcommands; the work is in local.py, tpu_vm.py, render.py.

Exit status: the job's (0 done, 42 retriable, 2 configuration or usage error, 1 other failure).
"""

from __future__ import annotations

import argparse
import os
import sys

from torchtpu.train.fault import EXIT_CONFIG

PROG = "torchtpu-launch"

# Each line runs as shown (tests/launch/test_launch_render.py runs them: --dry-run and the two
# renderers only print).
_EXAMPLES = """examples:
  torchtpu-launch local --num-hosts 2 --devices-per-host 4 -- torchtpu-train --config train_configs/debug_model.toml
  torchtpu-launch tpu-vm my-v5p-128 --zone us-east5-a --dry-run -- torchtpu-train --config train_configs/llama3_70b.toml
  torchtpu-launch gke --name llama70b --tpu v5p:4x4x4 --image IMAGE -- torchtpu-train --config train_configs/llama3_70b.toml
  torchtpu-launch skypilot --name llama70b --tpu v5p:4x4x4 -- torchtpu-train --config train_configs/llama3_70b.toml
(local and tpu-vm take --dry-run: print the commands instead of running them; gke and skypilot only print)
"""


class UsageError(Exception):
    pass


def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def _whole_number(minimum: int, requirement: str):
    """An argparse type: a whole number of at least `minimum` (`requirement` says so in the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be {requirement}")
        return value

    return parse


_positive = _whole_number(1, "at least 1")
_non_negative = _whole_number(0, "0 or more")


def trainer_args(cmd: list[str]) -> list[str] | None:
    """The torchtpu-train options in `cmd`, or None when cmd does not run torchtpu-train."""
    if cmd and os.path.basename(cmd[0]) == "torchtpu-train":
        return cmd[1:]
    if len(cmd) >= 3 and cmd[1] == "-m" and cmd[2] == "torchtpu.train":
        return cmd[3:]
    return None


def default_log_dir(cmd: list[str]) -> str:
    """<dump_folder>/logs of the torchtpu-train configuration in cmd, else ./torchtpu_logs.

    Reading the configuration here also refuses a bad one before any host starts."""
    args = trainer_args(cmd)
    if args is None:
        return os.path.abspath("torchtpu_logs")
    from torchtpu.train.config.job_config import ConfigError
    from torchtpu.train.config.manager import HelpRequested, load_config

    try:
        cfg = load_config(args)
    except HelpRequested:
        return os.path.abspath("torchtpu_logs")
    except ConfigError as e:
        raise UsageError(f"the training command's configuration: {e}") from None
    return os.path.abspath(os.path.join(cfg.job.dump_folder, "logs"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Start a torchtpu job on every host (torchelastic per host).",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="where", metavar="{local,tpu-vm,gke,skypilot,gke-serve}")
    sub.required = True

    lo = sub.add_parser(
        "local",
        help="N hosts of K XLA CPU devices on this machine",
        description="Run CMD as one multi-host job of N local hosts with K XLA CPU devices each.",
    )
    lo.add_argument("--num-hosts", type=_positive, required=True)
    lo.add_argument("--devices-per-host", type=_positive, required=True)
    lo.add_argument(
        "--max-restarts",
        type=_non_negative,
        default=0,
        help="whole-job restarts after a failure (torchelastic); each resumes from the newest checkpoint",
    )
    lo.add_argument(
        "--log-dir",
        default=None,
        help="per-attempt host logs (default: <dump_folder>/logs of the torchtpu-train configuration)",
    )
    lo.add_argument(
        "--grace-seconds",
        type=float,
        default=10.0,
        help="after a host fails, how long the others get to stop on their own before being killed",
    )
    lo.add_argument(
        "--shutdown-timeout",
        type=_positive,
        default=120,
        help="seconds a stopped host gets to write its checkpoint before SIGKILL",
    )
    lo.add_argument("--dry-run", action="store_true", help="print each host's command instead of running them")
    _add_tpu_vm(sub)
    _add_gke(sub)
    _add_skypilot(sub)
    _add_gke_serve(sub)
    return p


def _add_tpu_vm(sub) -> None:
    from . import tpu_vm

    tpu_vm.add_parser(sub)


def _add_gke(sub) -> None:
    from . import render

    render.add_gke_parser(sub)


def _add_skypilot(sub) -> None:
    from . import render

    render.add_skypilot_parser(sub)


def _add_gke_serve(sub) -> None:
    from . import render

    render.add_gke_serve_parser(sub)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, cmd = _split_command(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(own)
    except SystemExit as e:
        return EXIT_CONFIG if e.code else 0
    if args.where == "gke-serve":  # a server, not a training command: what follows -- goes to vLLM
        from . import render

        return render.gke_serve(args, cmd)
    try:
        if not cmd:
            raise UsageError(
                "no training command: give it after --, e.g. -- torchtpu-train --config train_configs/debug_model.toml"
            )
        if args.where == "local":
            from .local import dry_run_lines, run_local

            log_dir = args.log_dir or default_log_dir(cmd)
            if args.dry_run:
                lines = dry_run_lines(
                    args.num_hosts, args.devices_per_host, cmd, args.max_restarts, log_dir, args.shutdown_timeout
                )
                print("\n".join(lines))
                return 0
            return run_local(
                args.num_hosts,
                args.devices_per_host,
                cmd,
                max_restarts=args.max_restarts,
                log_dir=log_dir,
                grace_seconds=args.grace_seconds,
                shutdown_timeout=args.shutdown_timeout,
            )
        if args.where == "tpu-vm":
            from . import tpu_vm

            return tpu_vm.run(args, cmd)
        from . import render

        if args.where == "gke":
            return render.gke(args, cmd)
        return render.skypilot(args, cmd)
    except UsageError as e:
        print(f"{PROG} {args.where}: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
