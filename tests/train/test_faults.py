"""Fault paths of a real `torchtpu-train` process: one job per dump folder, Ctrl-C keeps the work,
a killed job's lock is taken over, and the log an operator reads (step n/N, ETA, saves with sizes)."""

from __future__ import annotations

import glob
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time

import pytest

from .debug_run import REPO, TWO_BLOCKS, debug_argv, process_env

STEPS = 6
ENV = process_env()


def _cmd(dump, data=None):
    """The trainer's command line; with `data` (a JSON Lines file) it reads that, skipping 1 bad record."""
    extra = ["--training.dataset_path", str(data), "--training.max_bad_records", "1"] if data else []
    argv = debug_argv(
        dump,
        STEPS,
        "--validation.no-enable",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
        *extra,
        *TWO_BLOCKS,  # what is checked here is the processes' behaviour, not the model's depth
        log_freq=1,
        warmup_steps=2,
    )
    return [sys.executable, "-m", "torchtpu.train", *argv]


def _data_with_a_bad_record(folder):
    """The bundled corpus as JSON Lines, its second line cut off (row 1 of 8 owns it: read at step 1)."""
    from torchtpu.train.documents import bundled_documents

    lines = [json.dumps({"text": d}) for d in bundled_documents("train")]
    lines[1] = lines[1][: len(lines[1]) // 2]
    path = folder / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _wait_for(predicate, proc, timeout=300, poll=0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    return False


def _losses(dump) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(dump, "metrics.jsonl")))}


def _lock_pid(dump):
    try:
        with open(os.path.join(dump, "torchtpu.lock"), encoding="utf-8") as f:
            return json.load(f)["pid"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.fixture(scope="module")
def guarded_run(tmp_path_factory):
    """A 6-step run with checkpoints every 2 steps; once it holds its dump folder, a second trainer
    is started on the same folder (it must be refused)."""
    folder = tmp_path_factory.mktemp("faults")
    dump, data = folder / "run", _data_with_a_bad_record(folder)
    first = subprocess.Popen(
        _cmd(dump, data), cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert _wait_for(lambda: _lock_pid(dump) == first.pid, first), first.communicate()[1][-3000:]
        t0, cpu0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
        second = subprocess.Popen(_cmd(dump, data), cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out2, err2 = second.communicate(timeout=300)
        wall = time.monotonic() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the second and its helpers: the first still runs
        cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
        first_running = first.poll() is None
        out1, err1 = first.communicate(timeout=600)
    finally:
        first.kill()
    return {
        "dump": dump,
        "data": data,
        "pid": first.pid,
        "first": (first.returncode, out1, err1, first_running),
        "second": (second.returncode, out2.decode(), err2.decode(), wall, cpu),
    }


def test_second_job_on_a_running_folder_exits_2_naming_it(guarded_run):
    rc, out, err, wall, cpu = guarded_run["second"]
    _, _, _, first_running = guarded_run["first"]
    assert first_running, "the first job ended before the second was refused: the test proves nothing"
    assert rc == 2, out + err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    dump, pid = guarded_run["dump"], guarded_run["pid"]
    assert lines[0].startswith(f"torchtpu-train: error: the dump folder {dump} is in use by "), lines[0]
    assert f"(host {socket.gethostname()}, pid {pid}, started 20" in lines[0]
    assert f"kill {pid}" in lines[0] and "another --job.dump_folder" in lines[0]
    assert not out.strip()  # it trained nothing and printed no step
    # It stops before the slow part of starting (the model, the compile): the interpreter, torch's and
    # jax's imports (about 4 s of CPU) and the configuration. On an idle host its wall time is its CPU
    # time; on a loaded one (the suite's other worker, other jobs) the wall time stretches with the
    # load (60 s at a load of 16 on 2 cores), so the 10 s bound is on the CPU time it used.
    print(f"second job refused after {wall:.1f} s ({cpu:.1f} s of CPU)")
    assert cpu < 10, cpu
    assert wall < 120


def test_first_job_is_untouched_and_its_log_reads_n_of_N_with_eta(guarded_run):
    rc, out, err, _ = guarded_run["first"]
    dump = guarded_run["dump"]
    assert rc == 0, err[-3000:]
    records = [json.loads(line) for line in open(dump / "metrics.jsonl")]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # each step once: nobody else wrote
    assert [r["bad_records"] for r in records] == [1] * STEPS  # [training] max_bad_records: skipped, counted
    assert "skipped a bad data record (1 of at most 1): " in err and "train.jsonl:2 is not valid JSON" in err
    assert sorted(os.listdir(dump / "checkpoint")) == ["step_2", "step_4", "step_6"]
    assert not os.path.exists(dump / "torchtpu.lock")  # released at the end
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(step_lines) == STEPS
    for n, line in enumerate(step_lines, 1):
        assert re.match(rf"step {n}/{STEPS} \| eta \d+:\d\d:\d\d \| loss ", line), line
    assert step_lines[-1].startswith(f"step {STEPS}/{STEPS} | eta 0:00:00 |")
    for s in (2, 4, 6):
        assert re.search(rf"checkpoint {dump}/checkpoint/step_{s} written: [\d.]+ [kMG]?B in [\d.]+ s", out), out


def test_ctrl_c_during_a_save_keeps_it_and_a_killed_jobs_lock_is_taken_over(guarded_run, tmp_path):
    """SIGINT while checkpoint step_2 (or a later one) is being written: the save completes, the process
    checkpoints the step it finished and exits 130. A trainer SIGKILLed while it holds the folder leaves
    its lock behind; the next start takes it over and resumes with the uninterrupted run's losses."""
    dump = tmp_path / "run"
    ckpt = dump / "checkpoint"
    data = guarded_run["data"]
    proc = subprocess.Popen(
        _cmd(dump, data), cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    in_save = _wait_for(lambda: glob.glob(str(ckpt / "step_*.orbax-checkpoint-tmp*")), proc, poll=0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-2000:] + err[-3000:]
    m = re.search(r"stopped \(SIGINT\) after step (\d+): checkpoint (\S+) written; exiting with 130", err)
    assert m, err[-3000:]
    stopped = int(m.group(1))
    assert m.group(2) == str(ckpt / f"step_{stopped}") and os.path.isdir(m.group(2))
    assert not glob.glob(str(ckpt / "*tmp*")), os.listdir(ckpt)  # nothing half written
    print(f"SIGINT landed {'during a save' if in_save else 'after the saves'}; stopped after step {stopped}")

    # a trainer killed while it holds the folder
    killed = subprocess.Popen(_cmd(dump, data), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert _wait_for(lambda: _lock_pid(dump) == killed.pid, killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert _lock_pid(dump) == killed.pid

    p = subprocess.run(_cmd(dump, data), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "took over the dump folder's stale lock" in p.stdout and f"pid {killed.pid} is not running" in p.stdout
    assert f"resumed from {ckpt / f'step_{stopped}'} (step {stopped}): " in p.stdout, p.stdout[-3000:]
    step_lines = [line for line in p.stdout.splitlines() if line.startswith("step ")]
    assert step_lines[0].startswith(f"step {stopped + 1}/{STEPS} | eta ")  # it counts from its step
    # the bad record (read at step 1) is in the checkpoint's count, and not read again
    after = [r["bad_records"] for r in map(json.loads, open(dump / "metrics.jsonl")) if r["step"] > stopped]
    assert after == [1] * (STEPS - stopped), after
    assert "skipped a bad data record" not in p.stderr
    resumed = _losses(dump)
    straight = _losses(guarded_run["dump"])
    for s in range(1, STEPS + 1):
        assert resumed[s] == pytest.approx(straight[s], rel=1e-5, abs=1e-6), (s, resumed, straight)


WATCH = """
import sys, time
from torchtpu.train.fault import PreemptionWatch

watch = PreemptionWatch()
print("ready", flush=True)
while not watch.should_stop(1):
    time.sleep(0.01)
print("stopping after a save", flush=True)
time.sleep(60)  # a save that takes long
print("saved", flush=True)
"""


def test_a_second_ctrl_c_aborts_at_once():
    proc = subprocess.Popen(
        [sys.executable, "-c", WATCH], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline() == "stopping after a save\n"  # the first Ctrl-C asked for a stop only
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - t0 < 5, (proc.returncode, err)
    assert "saved" not in out
    assert "Ctrl-C: stopping after this step" in err and "second Ctrl-C: stopping now" in err, err


def test_a_lock_from_another_host_is_stale_only_without_heartbeat(tmp_path):
    """Across hosts pids mean nothing: a lock written on another host holds while its heartbeat is
    fresh and is taken over once it is older than STALE_SECONDS (by the folder's own clock)."""
    from torchtpu.train.config.job_config import ConfigError
    from torchtpu.train.dump_lock import LOCK_NAME, STALE_SECONDS, DumpFolderLock

    path = tmp_path / LOCK_NAME
    holder = {"job": "run-7", "host": "tpu-vm-other-3", "pid": 4242, "started": "2026-01-01T00:00:00+00:00"}
    path.write_text(json.dumps(holder))
    with pytest.raises(ConfigError, match="in use by job run-7 \\(host tpu-vm-other-3, pid 4242.*on tpu-vm-other-3"):
        DumpFolderLock.acquire(str(tmp_path), job="run-8")
    joined = DumpFolderLock.acquire(str(tmp_path), job="run-7")  # the same job's other hosts join it
    assert not joined.owner
    joined.release()
    assert path.exists()  # a joining process never removes the job's lock

    old = time.time() - STALE_SECONDS - 30
    os.utime(path, (old, old))
    lock = DumpFolderLock.acquire(str(tmp_path), job="run-8")
    try:
        assert lock.owner and json.loads(path.read_text())["job"] == "run-8"
        assert "tpu-vm-other-3" in lock.describe_takeover() and "no heartbeat for" in lock.describe_takeover()
    finally:
        lock.release()
    assert not path.exists()


def test_a_lock_file_in_writing_is_waited_for_and_an_unreadable_old_one_taken_over(tmp_path):
    """Another host of the job has created the lock file but not yet written it (a slow machine): this
    start waits and joins the job instead of giving up. An unreadable file unchanged for STALE_SECONDS
    (its creator died in between) is taken over."""
    import threading

    from torchtpu.train.dump_lock import LOCK_NAME, STALE_SECONDS, DumpFolderLock

    path = tmp_path / LOCK_NAME
    path.write_text("")
    holder = {"job": "run-7", "host": "tpu-vm-other-3", "pid": 4242, "started": "2026-01-01T00:00:00+00:00"}
    writer = threading.Timer(0.5, lambda: path.write_text(json.dumps(holder)))
    writer.start()
    joined = DumpFolderLock.acquire(str(tmp_path), job="run-7")
    writer.join()
    assert not joined.owner and joined.record["pid"] == 4242
    joined.release()

    path.write_text('{"job": "run-')
    old = time.time() - STALE_SECONDS - 30
    os.utime(path, (old, old))
    lock = DumpFolderLock.acquire(str(tmp_path), job="run-8")
    try:
        assert lock.owner and json.loads(path.read_text())["job"] == "run-8"
        assert "unreadable" in lock.describe_takeover()
    finally:
        lock.release()
    assert not path.exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 100 MB tmpfs (mounting needs root: skipped without it), removed afterwards."""
    where = tmp_path / "disk"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100m", "tmpfs", str(where)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _console(cmd, env=ENV):
    p = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    return p.returncode, p.stdout.strip().splitlines()


def test_disk_full_ends_with_the_cause_in_few_lines(small_disk):
    """The first checkpoint (33 MB: the 2-block model's weights and AdamW moments) does not fit beside
    80 MB of other files: at most 20 console lines, the last naming the full disk and the fix; the
    traceback is in the host's log."""
    with open(small_disk / "other-files", "wb") as f:
        f.write(b"\0" * 80_000_000)
    dump = small_disk / "run"
    rc, lines = _console([*_cmd(dump), "--checkpoint.interval", "1"])
    assert rc == 1, "\n".join(lines[-30:])
    assert len(lines) <= 20, "\n".join(lines)
    assert lines[-1].startswith(f"torchtpu-train: error: CheckpointError: saving checkpoint {dump}/checkpoint/step_1")
    assert "the disk is full (No space left on device)" in lines[-1] and "Free space where" in lines[-1]
    log = glob.glob(str(dump / "logs" / "torchtpu-train.*.stderr.log"))
    assert log and f"in {log[0]} or run with --debug" in lines[-1]
    assert "Traceback (most recent call last)" in open(log[0]).read()  # what the console left out is kept


def test_read_only_dump_folder_exits_2_with_the_fix(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        rc, lines = _console(_cmd(ro / "run"))
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
    assert rc == 2, lines
    assert len(lines) == 1, lines
    assert lines[0] == (
        f"torchtpu-train: error: [job] dump_folder = '{ro / 'run'}' cannot be created: Read-only file system; "
        "choose another --job.dump_folder or make it writable"
    )


def test_unreachable_coordinator_ends_with_the_cause_in_few_lines():
    """Host 1 of a 2-host torchrun job whose store (MASTER_ADDR:MASTER_PORT) nobody serves."""
    from tests.processes import free_port

    port = free_port()
    env = dict(ENV, RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rc, lines = _console([*_cmd("/nonexistent-never-written"), "--comm.init_timeout_seconds", "3"], env=env)
    assert rc == 1, lines
    assert len(lines) <= 20, "\n".join(lines)
    assert lines[-1].startswith(
        f"torchtpu-train: error: CoordinatorUnreachable: process 1 could not reach torchelastic's store "
        f"(MASTER_ADDR:MASTER_PORT) at 127.0.0.1:{port} within 3 s"
    ), lines[-1]
    assert "Start every host of the job (process 0 of the job serves it)" in lines[-1]
    assert not any("c10d" in line or "TCPStore" in line for line in lines), lines  # library noise stays off


def test_console_filter_finds_the_last_word_behind_a_dying_threads_fragment():
    """Threads of a failed save print tracebacks in pieces (C's traceback writer emits the indentation and
    the source line separately), so the trainer's last line can land behind another thread's unfinished
    write; nothing after it reaches the console."""
    from torchtpu.train.console_filter import filter_lines

    final = "torchtpu-train: error: CheckpointError: saving checkpoint /x/step_1: the disk is full\n"
    lines = [
        "step 1/6\n",
        "Traceback (most recent call last):\n",
        '  File "loop.py", line 3, in call_soon\n',
        "    " + final,
        "raise RuntimeError('Event loop is closed')\n",
        "RuntimeError: Event loop is closed\n",
    ]
    out = []
    filter_lines(lines, out.append)
    assert out == ["step 1/6\n", final]


def test_a_launch_agents_console_filter_drops_c10d_traces_only():
    """A host agent of torchtpu-launch whose rendezvous store has gone (host 0's agent ended first)
    prints c10d's C++ warning with its stack frames: off the console; every other line, the training
    process's own included, passes."""
    from torchtpu.train.console_filter import drop_c10d

    trace = [
        "[W1203 11:53:43.817000123 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=5, "
        "addr=[localhost]:40512, remote=[localhost]:29500): failed to recv, got 0 bytes\n",
        "Exception raised from recvBytes at /pytorch/torch/csrc/distributed/c10d/Utils.hpp:682 (most recent "
        "call first):\n",
        "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f2c in libc10.so)\n",
        "frame #1: <unknown function> + 0x5d4f2ae (0x7f2c in libtorch_cpu.so)\n",
        "<omitting python frames>\n",
        "frame #28: __libc_start_main + 0x8b (0x7f2c in libc.so.6)\n",
        "\n",
    ]
    kept = [
        "[host 1] step 10/10 | eta 0:00:00 | loss 5.7738\n",
        "[host 1] [W1203 a line of the training process, filtered there if at all]\n",
        "torchtpu-launch agent: host 1: the training process ended with exit status 42\n",
    ]
    out = []
    drop_c10d([kept[0], *trace, kept[1], *trace, kept[2]], out.append)
    assert out == kept
