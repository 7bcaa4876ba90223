"""torchtpu-launch local: real multi-host jobs on this machine (torchelastic agents, jax.distributed
over loopback), with real kills and real signals, against single-process runs of the same training.

The model is torchtitan's debugmodel (2 of its 6 blocks, dim 64) with short sequences and few steps, so
that each job takes minutes on a small shared host; every test kills whatever it started (found by
a marker in the processes' environment) in a finally block.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from ..processes import cpu_flags, free_port

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
MARK = "TORCHTPU_TEST_LAUNCH_RUN"

# The debugmodel's width made narrow (dim 64 of 256, 4 heads, 2 KV heads): every collective of a
# multi-process step is a loopback TCP exchange whose time grows with the tensors (1-3 s a step at
# dim 256, a fraction of a second at 64). Every job of a test runs it, the references included;
# the MoE tests set their own.
NARROW = json.dumps({"dim": 64, "n_heads": 4, "n_kv_heads": 2})

# A small, fast job: debugmodel, 32-token sequences, 1 sequence per device, fp32, checkpoint every 2 steps;
# 2 of its 6 blocks (every collective of a multi-process step is a loopback TCP exchange, about 5 s a
# step at 6 blocks, and the fewer blocks, the fewer of them), NARROW wide ([model] flavor_overrides, last).
TRAIN = [
    "torchtpu-train",
    "--config",
    "train_configs/debug_model.toml",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "1",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--model.n_layers",
    "2",
    "--model.flavor_overrides",
    NARROW,
]


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _job_pids(mark: str) -> list[int]:
    """Every live process whose environment carries this test's marker."""
    out = []
    needle = f"{MARK}={mark}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    with open(f"/proc/{entry}/stat") as g:
                        if g.read().rsplit(")", 1)[1].split()[0] != "Z":
                            out.append(int(entry))
        except OSError:
            continue
    return out


def _kill_job(mark: str) -> None:
    for pid in _job_pids(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Job:
    """A command (the launcher, or one training process) run in the background with a marker."""

    def __init__(self, argv: list[str], log: Path, **env):
        self.mark = uuid.uuid4().hex
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=_env(**{MARK: self.mark}, **env),
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(pattern, self.text(), re.M)
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise AssertionError(f"no {pattern!r} within {timeout} s (exit {self.proc.poll()}):\n{self.text()[-4000:]}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.text()[-4000:]}") from None

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _kill_job(self.mark)
        self.proc.wait()
        self._out.close()


def launch(
    tmp: Path, name: str, hosts: int, devices: int, train_args: list[str], *launch_args: str, train=TRAIN, **env
) -> Job:
    return Job(
        [
            PY,
            "-m",
            "torchtpu.launch",
            "local",
            "--num-hosts",
            str(hosts),
            "--devices-per-host",
            str(devices),
            *launch_args,
            "--",
            *train,
            "--job.dump_folder",
            str(tmp / name),
            *train_args,
        ],
        tmp / f"{name}.console.log",
        **env,
    )


def single(tmp: Path, name: str, devices: int, train_args: list[str], train=TRAIN, **env) -> Job:
    return Job(
        [PY, "-m", "torchtpu.train", *train[1:], "--job.dump_folder", str(tmp / name), *train_args],
        tmp / f"{name}.console.log",
        XLA_FLAGS=cpu_flags(devices),
        JAX_PLATFORMS="cpu",
        **env,
    )


def run_to_end(job: Job, timeout: float = 900) -> str:
    try:
        code = job.wait(timeout)
        text = job.text()
        assert code == 0, text[-4000:]
        return text
    finally:
        job.close()


def validation_losses(folder: Path) -> dict[int, float]:
    """step -> held-out loss from process 0's metrics.jsonl, for the steps that evaluated."""
    out = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "validation/loss" in rec:
            out[rec["step"]] = rec["validation/loss"]
    return out


def losses(folder: Path, key: str = "loss") -> dict:
    """step -> loss (or another metric) from process 0's metrics.jsonl (a re-run step keeps its newest value)."""
    out = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec[key]
    return out


def checkpoint_steps(folder: Path) -> list[int]:
    ck = folder / "checkpoint"
    return sorted(int(p.name.split("_")[1]) for p in ck.glob("step_*")) if ck.is_dir() else []


def assert_losses_close(got: dict[int, float], want: dict[int, float], steps, rtol: float) -> None:
    np.testing.assert_allclose([got[s] for s in steps], [want[s] for s in steps], rtol=rtol)


def _training_pid(job: Job, host: int) -> int:
    """The training process (not the agent) of local host `host`."""
    for pid in _job_pids(job.mark):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"torchtpu.train" in cmd
            and f"TORCHTPU_HOST_INDEX={host}".encode() in env
            and b"TORCHELASTIC_RUN_ID" in b" ".join(e[:19] for e in env)
        ):
            return pid
    raise AssertionError(f"no training process of host {host} among {_job_pids(job.mark)}")


# The restart, preemption, kill and watchdog jobs are about processes, not the held-out loss: without
# validation (run multi-host by the 2 x 4 job below, checked in tests/train/test_validation.py) no
# process compiles the forward-only program or reads the held-out split at steps 1 and 10.
NO_VALIDATION = ["--validation.enable", "false"]


def test_kill_one_host_no_restarts_stops_the_job(tmp_path):
    # The surviving host sees its collective fail and exits 42 at once, often before the killed host's
    # agent has reported: the launcher must still name the killed host as the cause, not the survivor.
    job = launch(
        tmp_path, "kill", 2, 1, ["--training.steps", "30", "--comm.train_timeout_seconds", "300", *NO_VALIDATION]
    )
    try:
        job.wait_for(r"^\[host 0\] step +1/\d+ \|", 600)  # the hosts meet in every step from here
        victim = _training_pid(job, 1)
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        code = job.wait(60)
        elapsed = time.monotonic() - t0
        text = job.text()
        assert code != 0, text[-3000:]
        assert elapsed < 60
        assert re.search(r"job failed: host 1 killed by signal 9 \(SIGKILL\)", text), text[-3000:]
        assert _job_pids(job.mark) == [], "processes of the job are still running"
        print(f"launcher exited {code} {elapsed:.1f} s after the kill")
    finally:
        job.close()


# ---------------------------------------------------------------------------------------------
# 2 hosts x 4 devices against 1 process x 8 devices, and checkpoints moving between shapes
# ---------------------------------------------------------------------------------------------

SHORT = ["--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval", "2"]


# Full recomputation, which turns the layer scan on, and with it the blocks' stacked parameter storage
# (one [n_blocks, ...] array per slot, the blocks' Parameters its rows)
FULL = ["--activation_checkpoint.mode", "full"]


@pytest.fixture(scope="module")
def runs_8(tmp_path_factory):
    """The same 4 steps (checkpoints at 2 and 4) on 1 process x 8 devices and on 2 hosts x 4 devices,
    the 2-host job with the layer scan (FULL): one job checks both that the host split and that the
    scan change nothing. The 2-host jobs that resume below run without it."""
    tmp = tmp_path_factory.mktemp("shape8")
    run_to_end(single(tmp, "one_by_8", 8, SHORT))
    text = run_to_end(launch(tmp, "two_by_4", 2, 4, SHORT + FULL))
    return tmp, text


def _resume_from(tmp: Path, src: str, dst: str, step: int) -> Path:
    """A new job folder whose only checkpoint is `src`'s step `step`."""
    folder = tmp / dst / "checkpoint"
    folder.mkdir(parents=True)
    shutil.copytree(tmp / src / "checkpoint" / f"step_{step}", folder / f"step_{step}")
    return tmp / dst


def test_two_hosts_of_4_devices_with_the_layer_scan_match_one_process_of_8_without_it(runs_8):
    # Every row of the global batch is its own data stream, read by whichever process holds that row,
    # so the host split changes nothing but the order of the floating-point reductions; across 2
    # processes the scanned blocks train and evaluate as the unscanned ones do. The evaluation at
    # step 1 is a program that XLA:CPU would run with concurrent collectives under a loop on 2 CPU
    # hosts (scan.loop_unrolled says why).
    tmp, text = runs_8
    assert "[host 0] " in text and "[host 1] " in text
    assert "layer scan: the blocks run unrolled" in text, text[-3000:]
    for host in (0, 1):
        assert (tmp / "two_by_4" / "logs" / "attempt_1" / f"host_{host}.stdout.log").is_file()
    got, want = losses(tmp / "two_by_4"), losses(tmp / "one_by_8")
    assert sorted(got) == [1, 2, 3, 4]
    assert_losses_close(got, want, [1, 2, 3, 4], rtol=1e-5)
    got_val, want_val = validation_losses(tmp / "two_by_4"), validation_losses(tmp / "one_by_8")
    assert 1 in want_val and sorted(got_val) == sorted(want_val), (got_val, want_val)
    assert_losses_close(got_val, want_val, sorted(want_val), rtol=1e-5)


def test_checkpoint_of_1x8_resumes_on_2x4(runs_8):
    tmp, _ = runs_8
    _resume_from(tmp, "one_by_8", "resume_2x4", 2)
    run_to_end(launch(tmp, "resume_2x4", 2, 4, SHORT))
    got = losses(tmp / "resume_2x4")
    assert sorted(got) == [3, 4], got
    assert_losses_close(got, losses(tmp / "one_by_8"), [3, 4], rtol=1e-5)


def test_fsdp8_checkpoint_resumes_on_tp2_fsdp4(runs_8):
    # TP2 x FSDP4 has 4 data-parallel ranks: 2 sequences each keep the micro-batch of 8 sequences
    # (8 row streams) the checkpoint was written with, so the same data continues
    tmp, _ = runs_8
    _resume_from(tmp, "one_by_8", "resume_tp2", 2)
    text = run_to_end(
        single(
            tmp,
            "resume_tp2",
            8,
            SHORT + ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "2"],
        )
    )
    assert "'dp_shard': 4, 'tp': 2" in text, text[-3000:]
    got = losses(tmp / "resume_tp2")
    assert sorted(got) == [3, 4], got
    assert_losses_close(got, losses(tmp / "one_by_8"), [3, 4], rtol=1e-5)


def test_checkpoint_of_the_scanned_2x4_job_resumes_on_1x8_without_the_scan(runs_8):
    # The scanned job's checkpoint (per-parameter format) resumes unscanned on 1 host: the data
    # position is kept per row of the global batch, not per host, so it carries over.
    tmp, _ = runs_8
    _resume_from(tmp, "two_by_4", "resume_scan_1x8", 2)
    text = run_to_end(single(tmp, "resume_scan_1x8", 8, SHORT))
    assert re.search(r"resumed from \S+ \(step 2\)", text), text[-3000:]
    got = losses(tmp / "resume_scan_1x8")
    assert sorted(got) == [3, 4], got
    assert_losses_close(got, losses(tmp / "one_by_8"), [3, 4], rtol=1e-5)


def test_resume_with_another_global_batch_is_refused_with_the_fix(runs_8):
    # TP2 x FSDP4 with 1 sequence per rank would read 4 of the 8 row streams: another global batch,
    # another data stream. Refused (exit 2) with a line naming both batches and the fix.
    tmp, _ = runs_8
    _resume_from(tmp, "one_by_8", "refuse_tp2", 2)
    job = single(tmp, "refuse_tp2", 8, SHORT + ["--parallelism.tensor_parallel_degree", "2"])
    try:
        assert job.wait(900) == 2, job.text()[-3000:]
    finally:
        job.close()
    assert re.search(
        r"data position is for micro-batches of 8 sequences; this job's are 4 .*"
        r"--training.local_batch_size 2 .*exclude_from_loading dataloader",
        job.text(),
    ), job.text()[-3000:]


# ---------------------------------------------------------------------------------------------
# Expert parallelism across hosts: Qwen3 MoE on 2 hosts x 4 devices against 1 process x 8
# ---------------------------------------------------------------------------------------------

# The Qwen3 MoE debug flavor made narrow as tests/train/test_families.py makes it (8 experts, 2 per
# token; [model] flavor_overrides), 2 blocks, 32-token sequences, no activation checkpointing
MOE_ARGS = json.dumps(
    {
        "dim": 64,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 16,
        "hidden_dim": 128,
        "moe_inter_dim": 64,
        "moe_args": {"num_experts": 8, "top_k": 2},
    }
)
MOE_TRAIN = [
    *TRAIN[:2],
    "train_configs/qwen3_debug.toml",
    "--model.flavor",
    "debugmodel_moe",
    "--activation_checkpoint.mode",
    "none",
    *TRAIN[3:-1],
    MOE_ARGS,
]
MOE_SHORT = ["--training.steps", "3", *NO_VALIDATION]


def test_two_hosts_with_expert_parallel_4_match_one_process_of_8_without_it(tmp_path):
    # EP 4 x efsdp 2 over 2 processes: each layer's tokens reach the chips holding their experts by
    # all-to-alls that cross the processes, and come back. Expert parallelism changes nothing but
    # where each (token, expert) row is computed, so the losses and every step's tokens per expert
    # are those of the EP 1 job in one process. (A checkpoint written by 2 processes resuming in one:
    # the scanned 2 x 4 job's above; under another expert-parallel degree: tests/train/test_families.py.)
    ep4 = ["--parallelism.expert_parallel_degree", "4"]
    run_to_end(single(tmp_path, "one_by_8", 8, MOE_SHORT, train=MOE_TRAIN))
    text = run_to_end(launch(tmp_path, "two_by_4_ep4", 2, 4, MOE_SHORT + ep4, train=MOE_TRAIN))
    assert "[host 1] " in text
    assert "(experts over ep 4 x efsdp 2)" in text, text[-3000:]
    got, want = losses(tmp_path / "two_by_4_ep4"), losses(tmp_path / "one_by_8")
    assert sorted(got) == [1, 2, 3]
    assert_losses_close(got, want, [1, 2, 3], rtol=1e-5)
    counts = losses(tmp_path / "two_by_4_ep4", "moe/tokens_per_expert")
    assert counts == losses(tmp_path / "one_by_8", "moe/tokens_per_expert"), counts
    assert all(sum(row) == 8 * 32 * 2 for step in counts.values() for row in step), counts


# ---------------------------------------------------------------------------------------------
# Restarts, preemption, the watchdog (2 hosts x 1 device: the cheapest real multi-host job)
# ---------------------------------------------------------------------------------------------

LONG_STEPS = 12  # the preemption lands a few steps after the SIGTERM; the rerun needs 2 steps more
LONG = [
    "--training.steps",
    str(LONG_STEPS),
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--checkpoint.keep_latest_k",
    "0",
    *NO_VALIDATION,
]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same job in one process over 2 devices. It computes what the 2 x 1 job does
    (each process holds one of the 2 shards; the reductions run over the same 2 parts in the same
    order) and takes seconds, where 2 processes take minutes (every collective goes over loopback
    TCP). The interrupted 2 x 1 jobs below match it to 1e-6."""
    tmp = tmp_path_factory.mktemp("ref1x2")
    run_to_end(single(tmp, "ref", 2, LONG))
    return losses(tmp / "ref")


def test_sigterm_to_launcher_checkpoints_exits_42_and_the_rerun_survives_a_killed_host(tmp_path, uninterrupted):
    # Two tests in one (they ran the same 2 x 1 job from scratch): the preempted job (SIGTERM to the
    # launcher: every host checkpoints and exits 42) is rerun with a restart allowed, and that rerun,
    # once it has resumed and trained on, loses a host to SIGKILL: torchelastic restarts both hosts,
    # attempt 2 resumes from the newest checkpoint and the job ends with 0, matching the reference.
    job = launch(tmp_path, "preempt", 2, 1, LONG)
    try:
        job.wait_for(r"^\[host 0\] step +3/\d+ \|", 600)
        job.proc.send_signal(signal.SIGTERM)
        code = job.wait(180)
        text = job.text()
    finally:
        job.close()
    assert code == 42, text[-4000:]
    m = re.search(r"preempted \(SIGTERM\) after step (\d+): checkpoint \S+ written; exiting with 42", text)
    assert m, text[-4000:]
    stopped = int(m.group(1))
    assert stopped > 2 and checkpoint_steps(tmp_path / "preempt")[-1] == stopped
    assert stopped + 2 < LONG_STEPS, (
        f"preempted only after step {stopped}: the rerun has no steps left to lose a host in"
    )
    for host in (0, 1):  # every training process took the preemption path and exited 42
        log = (tmp_path / "preempt" / "logs" / "attempt_1" / f"host_{host}.stderr.log").read_text()
        assert f"after step {stopped}: checkpoint" in log and "exiting with 42" in log, log[-2000:]

    job = launch(tmp_path, "preempt", 2, 1, LONG, "--max-restarts", "1")
    try:
        job.wait_for(rf"^\[host 0\] step +{stopped + 2}/\d+ \|", 600)
        os.kill(_training_pid(job, 1), signal.SIGKILL)
        m = job.wait_for(r"attempt 2: resumed from \S+ \(step (\d+)\)", 600)
        code = job.wait(600)
        rerun = job.text()
        assert code == 0, rerun[-4000:]
    finally:
        job.close()
    # attempt 1 of the rerun continued from the preemption's checkpoint
    assert re.search(rf"resumed from \S+ \(step {stopped}\)", rerun), rerun[-3000:]
    resumed = int(m.group(1))
    assert resumed >= stopped and resumed in checkpoint_steps(tmp_path / "preempt"), resumed
    assert "[torchtpu-train] attempt 2 (torchelastic restarts allowed: 1)" in rerun
    assert (tmp_path / "preempt" / "logs" / "attempt_2" / "host_1.stdout.log").is_file()
    got = losses(tmp_path / "preempt")  # each step's newest value: the rerun's, after its restart's
    assert_losses_close(got, uninterrupted, range(stopped + 1, LONG_STEPS + 1), rtol=1e-6)


def test_stuck_host_trips_the_watchdog(tmp_path):
    job = launch(
        tmp_path,
        "stuck",
        2,
        1,
        [
            "--training.steps",
            "12",
            "--comm.train_timeout_seconds",
            "10",
            "--debug.inject_stall",
            "1:4:600",
            *NO_VALIDATION,
        ],
    )
    try:
        job.wait_for(r"\[debug\] inject_stall: process 1 stalls", 600)
        t0 = time.monotonic()
        code = job.wait(60)
        elapsed = time.monotonic() - t0
        text = job.text()
    finally:
        job.close()
    assert code == 42, text[-4000:]
    assert elapsed < 45, elapsed
    assert "step watchdog: no training step finished" in text
    # faulthandler's dump of the stuck host shows where it sleeps
    assert re.search(r"Thread 0x[0-9a-f]+ \(most recent call first\):", text), text[-4000:]
    assert re.search(r'fault\.py", line \d+ in stall$', text, re.M), text[-4000:]  # [debug] inject_stall's sleep
    print(f"job exited 42 {elapsed:.1f} s after the stall began")


# ---------------------------------------------------------------------------------------------
# Exit statuses through torchelastic (a tiny program instead of the trainer)
# ---------------------------------------------------------------------------------------------


def _program(tmp: Path, name: str, code: str, *launch_args: str) -> Job:
    return Job(
        [
            PY,
            "-m",
            "torchtpu.launch",
            "local",
            "--num-hosts",
            "2",
            "--devices-per-host",
            "1",
            "--log-dir",
            str(tmp / name),
            *launch_args,
            "--",
            PY,
            "-c",
            code,
        ],
        tmp / f"{name}.console.log",
    )


ATTEMPT = "import os, sys; n = int(os.environ['TORCHTPU_ATTEMPT']); print('attempt', n); "


def test_exit_42_restarts_the_whole_job(tmp_path):
    job = _program(
        tmp_path,
        "r42",
        ATTEMPT + "import time; "
        # attempt 1: one host fails with 42 while the other is still working
        "(sys.exit(42) if os.environ['RANK'] == '1' else time.sleep(120)) if n == 1 else None",
        "--max-restarts",
        "1",
    )
    try:
        assert job.wait(300) == 0, job.text()[-3000:]
    finally:
        job.close()
    text = job.text()
    assert "[host 0] attempt 2" in text and "[host 1] attempt 2" in text
    assert (tmp_path / "r42" / "attempt_2" / "host_0.stdout.log").read_text() == "attempt 2\n"


def test_configuration_error_is_not_retried(tmp_path):
    job = _program(tmp_path, "r2", ATTEMPT + "sys.exit(2)", "--max-restarts", "2")
    try:
        assert job.wait(300) == 2, job.text()[-3000:]
    finally:
        job.close()
    text = job.text()
    assert "attempt 2" not in text
    assert re.search(r"job failed: host \d exit status 2 \(configuration or usage error\)", text), text


@pytest.mark.parametrize(
    ("abort_at", "exit_42_at", "status"),
    [
        # host 0 exits 42 and JAX aborts host 1 at once: whichever agent reports first, the job is retriable
        (0.0, 1.5, 42),
        (1.5, 0.0, 42),
        # host 1 aborts on its own, host 0's watchdog ends it long after: the abort is the cause
        (0.0, 8.0, 1),
    ],
    ids=["abort-seen-first", "42-seen-first", "abort-long-before"],
)
def test_an_abort_beside_a_42_is_classified_by_when_it_came(tmp_path, abort_at, exit_42_at, status):
    code = (
        "import os, sys, time; r = os.environ['RANK']; "
        f"time.sleep(2 + ({exit_42_at} if r == '0' else {abort_at})); "
        "sys.exit(42) if r == '0' else os.abort()"
    )
    job = _program(tmp_path, "abort", code, "--grace-seconds", "30")
    try:
        assert job.wait(120) == status, job.text()[-3000:]
    finally:
        job.close()
    cause = "host 0 exit status 42" if status == 42 else "host 1 killed by signal 6 (SIGABRT)"
    assert f"job failed: {cause}" in job.text(), job.text()[-3000:]


def test_init_timeout_bounds_the_wait_for_missing_hosts(tmp_path):
    """[comm] init_timeout_seconds is jax.distributed's join timeout: process 0 of a 2-process job whose
    peer never comes gives up after it, not after the 300 s default."""
    code = (
        "import time, torchtpu\nfrom torchtpu.distributed import initialize\n"
        "print('joining', time.monotonic(), flush=True)\n"
        "initialize('127.0.0.1:{port}', 2, 0, init_timeout_seconds={t})\n"
    )
    env = _env(JAX_PLATFORMS="cpu")
    port_long = free_port()
    port_short = next(p for p in iter(free_port, None) if p != port_long)
    # Both processes start together: the one with the long timeout waits while the short one runs out.
    long = subprocess.Popen(
        [PY, "-c", code.format(port=port_long, t=120)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    short = subprocess.Popen(
        [PY, "-c", code.format(port=port_short, t=3)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = short.communicate(timeout=120)
        assert short.returncode != 0
        assert "DEADLINE_EXCEEDED" in out or "Deadline Exceeded" in out, out[-2000:]
        line = long.stdout.readline()  # the long one has started to wait for its peer
        assert line.startswith("joining"), line
        # 10 s after it began to wait, well past the short timeout: it is still waiting
        while time.monotonic() < float(line.split()[1]) + 10:
            assert long.poll() is None
            time.sleep(0.2)
        assert long.poll() is None
    finally:
        for p in (short, long):
            p.kill()
            p.wait()
