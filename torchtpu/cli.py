"""Console entry points declared in pyproject.toml.

`torchtpu-train` (also `python -m torchtpu.train`) reads the configuration (defaults, then the TOML
file, then command-line options) and hands it to the training loop in torchtpu.train.trainer.
Exit status (torchtpu/train/fault.py):

    0    done
    1    any other failure: a full disk, a coordinator that cannot be reached, ... (one line on stderr)
    2    configuration or usage error, including a dump folder that another job holds or that cannot
         be written (one line on stderr)
    42   preempted (SIGTERM) or stuck: a checkpoint of the last step is written; retriable
    130  Ctrl-C: the first one stops after the step and its checkpoint, a second one at once

Without --debug the console gets stderr through torchtpu/train/console_filter.py (no tracebacks,
no library noise) and `<dump_folder>/logs/torchtpu-train.<host>.stderr.log` gets all of it, with the
traceback of the error that ended the run; --debug prints everything on the console.

`torchtpu-launch` (torchtpu.launch.cli) starts a job on every host; its exit status is the job's:
0 done, 42 retriable (preempted or stuck), 2 configuration or usage error, 1 other failure.
"""

from __future__ import annotations

import os
import sys
import traceback

_PROG = "torchtpu-train"
_REEXEC_MARK = "_TORCHTPU_TRAIN_REEXEC"
_FILTER_MARK = "_TORCHTPU_TRAIN_STDERR_LOG"


def _wants_debug(args: list[str]) -> bool:
    """--debug / --debug.verbose seen on the command line (before the config is parsed)."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--debug", "--debug.verbose"):
            if eq:
                return value.strip().lower() in ("true", "1", "yes", "on")
            following = args[i + 1].strip().lower() if i + 1 < len(args) else ""
            return following not in ("false", "0", "no", "off")
    return False


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    lines = text.splitlines()
    first = lines[0].strip() if lines else ""
    if len(lines) > 1:
        first += " ..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _xla_backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except Exception:  # private API moved: assume the worst
        return True


def _only_cpu_devices() -> bool:
    try:
        import jax

        return all(d.platform == "cpu" for d in jax.devices())
    except Exception:
        return False


def _apply_xla_env(cfg, args: list[str], as_program: bool) -> None:
    """Make tpu.xla_flags / tpu.libtpu_init_args take effect.

    XLA reads them when its backend starts. If that already happened (importing torchtpu starts it),
    a command-line run on CPU devices re-executes itself once with the flags in the environment;
    otherwise the flags cannot apply any more and a warning says how to set them.
    """
    from torchtpu.train.xla_env import xla_env_updates

    updates = xla_env_updates(cfg)
    if not updates:
        return
    if not _xla_backend_started():
        os.environ.update(updates)
        return
    if as_program and not os.environ.get(_REEXEC_MARK) and _only_cpu_devices():
        env = dict(os.environ, **updates)
        env[_REEXEC_MARK] = "1"
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "torchtpu.train", *args], env)
    settings = " ".join(f"{k}='{v}'" for k, v in updates.items())
    print(
        f"{_PROG}: warning: [tpu] xla_flags / libtpu_init_args not applied because the XLA backend had already "
        f"started; set them in the environment instead: {settings}",
        file=sys.stderr,
    )


def _filter_stderr(cfg) -> str | None:
    """Send this process's stderr through torchtpu/train/console_filter.py (library noise off the
    console); returns the host's log file, which gets everything. Once per process, also across the
    re-execution of _apply_xla_env."""
    import socket
    import subprocess

    from torchtpu.train import console_filter

    if os.environ.get(_FILTER_MARK):
        return os.environ[_FILTER_MARK]
    folder = os.path.join(cfg.job.dump_folder, "logs")
    log = os.path.join(folder, f"torchtpu-train.{socket.gethostname()}.stderr.log")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        log = os.devnull
    sys.stderr.flush()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", console_filter.__file__, log], stdin=subprocess.PIPE, stdout=sys.stderr.fileno()
        )
    except OSError:
        return None
    os.dup2(proc.stdin.fileno(), sys.stderr.fileno())  # fd 2 is now the only writer: EOF when this process ends
    proc.stdin.close()
    os.environ[_FILTER_MARK] = log
    return log


def _log_traceback(log: str | None) -> None:
    if log and log != os.devnull:
        try:
            with open(log, "a", encoding="utf-8") as f:
                traceback.print_exc(file=f)
        except OSError:
            pass


def train_main(argv: list[str] | None = None) -> int:
    """`torchtpu-train --config FILE [--SECTION.KEY VALUE ...]`; returns the exit status."""
    as_program = argv is None
    args = list(sys.argv[1:] if argv is None else argv)
    log = None  # the host's full stderr, when the console gets it filtered
    debug = _wants_debug(args)
    from torchtpu.train.config.job_config import ConfigError, topology_num_devices
    from torchtpu.train.config.manager import HelpRequested, load_config
    from torchtpu.train.parallel_dims import resolve_dims

    try:
        try:
            cfg = load_config(args)
        except HelpRequested as h:
            sys.stdout.write(h.text)
            return 0
        debug = debug or cfg.debug.verbose
        if as_program and not debug:
            log = _filter_stderr(cfg)
        if cfg.job.print_config:
            cfg.job.print_config = False  # the printed file can be used as is
            sys.stdout.write(cfg.to_toml())
            sys.stdout.flush()
            return 0
        if cfg.tpu.topology:
            # The target slice is named: check the configuration against it before any device work.
            resolve_dims(cfg, topology_num_devices(cfg.tpu.topology))
        from torchtpu.train.startup import lock_before_start

        lock_before_start(cfg)  # a second job on this dump folder is refused before the slow part
        _apply_xla_env(cfg, args, as_program)
        from torchtpu.train.trainer import main as run

        # The trainer calls resolve_dims(cfg, <global device count>) once the devices are known.
        status = run(cfg)
        return status if isinstance(status, int) and not isinstance(status, bool) else 0
    except ConfigError as e:
        if debug:
            traceback.print_exc()
        _log_traceback(log)
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        from torchtpu.train.fault import EXIT_CONFIG, leave_job

        return leave_job(EXIT_CONFIG)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(f"{_PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from torchtpu.train.fault import failure_status, leave_job

        status, why = failure_status(e)
        _log_traceback(log)
        if debug:
            traceback.print_exc()
            print(f"{_PROG}: error: {_one_line(e)}{why}", file=sys.stderr)
        else:
            where = f"in {log} or " if log and log != os.devnull else ""
            print(f"{_PROG}: error: {_one_line(e)}{why} (the traceback: {where}run with --debug)", file=sys.stderr)
        return leave_job(status)


def launch_main(argv: list[str] | None = None) -> int:
    """`torchtpu-launch {local,tpu-vm,gke,skypilot} ... -- CMD ...`; returns the exit status."""
    from torchtpu.launch.cli import main

    return main(argv)
