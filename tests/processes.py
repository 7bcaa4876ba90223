"""Helpers for tests that run real processes: the XLA flags of a test process, a free loopback port
for a coordinator, and the processes of one multi-host job started together."""

from __future__ import annotations

import socket
import subprocess

# XLA:CPU's LLVM code generation at optimization level 0 in every test process (tests/conftest.py sets
# it for pytest's own): the suite's programs are small, so compiling them is most of what running them
# costs (a file of transformers models 17% faster, a sharded training test 12%). Tests compare against
# PyTorch within their tolerances either way; the TPU compiler's AOT programs do not change (the debug
# model's v5p dry-run report is the same line for line).
# And XLA:CPU's classic elemental emitters instead of its fusion emitters: half the compile time of the
# OpInfo programs (backend compile 16.5 -> 8.5 s on 50 OpInfos) and 21% less CPU on three files of
# transformers models, modules and scanned sharded training, measured side by side with empty
# compilation caches. Tests that read the structure of XLA:CPU's compiled HLO compile with the default
# pipeline (`DEFAULT_CPU_PIPELINE`), since the classic one expands a scatter-add into a while loop.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
# compiler options (torchtpu.backend.aot.compiler_options) for a compile with the default XLA:CPU pipeline
DEFAULT_CPU_PIPELINE = {"xla_cpu_use_fusion_emitters": True}


def cpu_flags(devices: int) -> str:
    """XLA_FLAGS for a test process with `devices` XLA CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_together(commands, env, timeout=600) -> list[str]:
    """Start every command at once (the hosts of one job), wait for all of them, assert that each
    exited with status 0 (showing the end of its output if not) and return their outputs, stdout
    and stderr together. Whatever is still running when one times out is killed."""
    procs = [
        subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in commands
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def run_with_peak_rss(cmd, env, *, rss_limit: int, timeout: float, cwd=None) -> tuple[int, str, int]:
    """Run `cmd` (stdout and stderr to a temporary file) and return (exit status, output, peak
    resident set in bytes, the kernel's count for that process). The process is killed once its
    resident set passes `rss_limit` bytes (read every 50 ms), so that a test of a memory bound fails
    rather than taking the machine's memory from the other processes; past `timeout` seconds too."""
    import os
    import signal
    import tempfile
    import time

    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, text=True)
        start, why = time.monotonic(), None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if why is None:
                rss = _resident_bytes(proc.pid)
                if rss > rss_limit:
                    why = f"killed at {rss / 2**30:.2f} GiB resident, past the {rss_limit / 2**30:.2f} GiB limit"
                elif time.monotonic() - start > timeout:
                    why = f"killed after {timeout:.0f} s"
                if why is not None:
                    os.kill(proc.pid, signal.SIGKILL)
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        out = log.read() + (f"\n[{why}]" if why else "")
    return proc.returncode, out, usage.ru_maxrss * 1024


def _resident_bytes(pid: int) -> int:
    """The resident set of process `pid` in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
