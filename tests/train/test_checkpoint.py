"""Checkpoint/resume with real Orbax checkpoints on disk (torchtpu.train.checkpoint.manager)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
import torch
import torch.nn as nn
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import torchtpu
from torchtpu.train.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    load_model_state,
    load_optimizer_state,
    model_state,
    optimizer_state,
)

from ..processes import cpu_flags
from .debug_run import REPO, TWO_BLOCKS, debug_argv, process_env


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to("tpu")


def batches(n, seed=123):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def train(model, opt, data):
    for x, y in data:
        opt.zero_grad()
        loss = (model(x.to("tpu")) - y.to("tpu")).square().mean()
        loss.backward()
        opt.step()


def cpu_copy(tree):
    """Detached CPU copies of every tensor in a nested state (for later comparison)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().clone()
    if isinstance(tree, dict):
        return {k: cpu_copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(cpu_copy(v) for v in tree)
    return tree


def assert_same(actual, expected, path="state"):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual)}"
        assert actual.dtype == expected.dtype, f"{path}: {actual.dtype} vs {expected.dtype}"
        torch.testing.assert_close(actual.detach().cpu(), expected, rtol=0, atol=0, msg=lambda m: f"{path}: {m}")
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), f"{path}: keys {set(actual)} vs {set(expected)}"
        for k in expected:
            assert_same(actual[k], expected[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), f"{path}: {actual!r} vs {expected!r}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}[{i}]")
    elif isinstance(expected, np.ndarray):
        np.testing.assert_array_equal(actual, expected)
        assert actual.dtype == expected.dtype
    else:
        assert actual == expected and type(actual) is type(expected), f"{path}: {actual!r} vs {expected!r}"


def scramble(model, opt):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    v.fill_(-3.0)


@pytest.mark.parametrize("async_mode", ["sync", "async"])
def test_roundtrip_model_adamw_and_extras(tmp_path, async_mode):
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, batches(2))
    extras = {
        "step": 2,
        "dataloader": {"epoch": 0, "position": 12, "rng": b"\x00\x01", "order": (3, 1, 2), 5: None},
        "lr_scheduler": {"last_epoch": 2, "base_lrs": [0.01], "_step_count": 3, "factor": float("inf")},
        "cpu_bf16": torch.arange(4, dtype=torch.bfloat16),
        "np": np.arange(6, dtype=np.int32).reshape(2, 3),
        "np_scalar": np.float32(1.5),
    }
    state = {"model": model_state(model), "optim": optimizer_state(opt), **extras}
    expected = cpu_copy(state)
    params = list(model.parameters())
    moments = [opt.state[p]["exp_avg"] for p in params]

    ckpt = CheckpointManager(str(tmp_path / "ckpt"), interval=2, async_mode=async_mode)
    assert ckpt.save(2, state)
    ckpt.wait()
    assert ckpt.latest_step() == 2

    scramble(model, opt)
    restored = ckpt.restore(target={"model": model_state(model), "optim": optimizer_state(opt)})
    ckpt.close()

    assert_same(restored, expected)
    # parameters and optimizer moments are the same Python objects, refilled in place
    assert all(a is b for a, b in zip(restored["model"].values(), params))
    assert all(opt.state[p]["exp_avg"] is m for p, m in zip(params, moments))
    assert all(isinstance(p, torchtpu.TpuTensor) for p in model.parameters())
    # AdamW's 'step' is a CPU float tensor; it round-trips as one (in place)
    step_t = restored["optim"]["state"][0]["step"]
    assert step_t is opt.state[params[0]]["step"] and step_t.device.type == "cpu" and float(step_t) == 2.0
    assert restored["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    load_model_state(model, restored["model"])
    load_optimizer_state(opt, restored["optim"])
    assert_same(cpu_copy(optimizer_state(opt)), expected["optim"])


OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=3e-2, weight_decay=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=5e-2, momentum=0.9),
}


@pytest.mark.parametrize("optim", sorted(OPTIMIZERS))
def test_resume_equivalence(tmp_path, optim):
    data = batches(5)
    # Reference: 3 steps, save, 2 more steps.
    model = tiny_model(0)
    opt = OPTIMIZERS[optim](model.parameters())
    train(model, opt, data[:3])
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), interval=3)
    assert ckpt.save(3, {"model": model_state(model), "optim": optimizer_state(opt), "step": 3})
    ckpt.close()
    train(model, opt, data[3:])
    reference = cpu_copy(model_state(model))

    # Resume: a differently initialised model and a fresh (lazily initialised) optimizer.
    model2 = tiny_model(1)
    opt2 = OPTIMIZERS[optim](model2.parameters())
    ckpt2 = CheckpointManager(str(tmp_path / "ckpt"), interval=3)
    restored = ckpt2.restore(target={"model": model_state(model2), "optim": optimizer_state(opt2)})
    load_model_state(model2, restored["model"])
    load_optimizer_state(opt2, restored["optim"])
    assert restored["step"] == 3
    train(model2, opt2, data[restored["step"] :])
    assert_same(cpu_copy(model_state(model2)), reference)


def mesh8():
    return Mesh(np.array(jax.devices()[:8]), ("x",))


def sharded(arr, spec):
    return torchtpu.from_jax(jax.device_put(arr, NamedSharding(mesh8(), spec)))


def test_sharded_roundtrip_keeps_target_sharding(tmp_path):
    rng = np.random.default_rng(0)
    w = sharded(rng.standard_normal((16, 4), dtype=np.float32), P("x")).requires_grad_()
    b = sharded(rng.standard_normal((8,), dtype=np.float32), P("x")).requires_grad_()
    opt = torch.optim.AdamW([w, b], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        ((w * w).sum() + (b * 3).sum()).backward()
        opt.step()
    state = {"params": {"w": w, "b": b}, "optim": optimizer_state(opt)}
    expected = cpu_copy(state)
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), interval=1)
    ckpt.save(1, state)
    ckpt.wait()
    # each device's shard is written, nothing is gathered to one file per array:
    assert torchtpu.to_jax(w).sharding.spec == P("x")

    # Restoring into the live state refills the same objects and keeps their layout.
    restored = ckpt.restore(target=state)
    assert restored["params"]["w"] is w and restored["optim"]["state"][0]["exp_avg"] is opt.state[w]["exp_avg"]
    assert_same(restored, expected)
    for t in (w, b, opt.state[w]["exp_avg"], opt.state[w]["exp_avg_sq"]):
        sh = torchtpu.to_jax(t).sharding
        assert isinstance(sh, NamedSharding) and sh.spec == P("x") and sh.mesh.devices.size == 8, sh

    # Fresh sharded targets (e.g. a new process) get the values with their own sharding.
    w1 = sharded(np.zeros((16, 4), np.float32), P("x"))
    b1 = sharded(np.zeros((8,), np.float32), P("x"))
    restored = ckpt.restore(target={"params": {"w": w1, "b": b1}})
    assert restored["params"]["w"] is w1
    assert_same(restored["params"], expected["params"])
    for t in (w1, b1):
        sh = torchtpu.to_jax(t).sharding
        assert isinstance(sh, NamedSharding) and sh.spec == P("x") and sh.mesh.devices.size == 8, sh

    # A target with another layout gets the checkpoint's values in its own layout.
    w2 = sharded(np.zeros((16, 4), np.float32), P())
    b2 = sharded(np.zeros((8,), np.float32), P())
    restored = ckpt.restore(target={"params": {"w": w2, "b": b2}})
    assert restored["params"]["w"] is w2
    torch.testing.assert_close(w2.cpu(), expected["params"]["w"], rtol=0, atol=0)
    assert torchtpu.to_jax(w2).sharding.spec == P()

    # Restoring a sharded optimizer state into a fresh optimizer puts its moments on the params' layout.
    opt2 = torch.optim.AdamW([w, b], lr=1e-2)
    restored = ckpt.restore(target={"optim": optimizer_state(opt2)})
    load_optimizer_state(opt2, restored["optim"])
    for p in (w, b):
        assert torchtpu.to_jax(opt2.state[p]["exp_avg"]).sharding.is_equivalent_to(torchtpu.to_jax(p).sharding, p.dim())
    assert_same(cpu_copy(optimizer_state(opt2))["state"], expected["optim"]["state"])
    ckpt.close()


def test_async_save_interval_and_wait(tmp_path):
    x = torch.arange(1 << 16, dtype=torch.float32).to("tpu")
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), interval=5, async_mode="async")
    assert not ckpt.save(3, {"x": x})  # not due
    assert ckpt.save(5, {"x": x})  # due: started in the background
    assert not ckpt.save(5, {"x": x})  # already being written
    with torch.no_grad():
        x.add_(1)  # training continues; the saved values are unaffected
    assert ckpt.save(7, {"x": x}, force=True)  # forced (e.g. at the last step)
    ckpt.wait()
    assert ckpt.all_steps() == [5, 7]
    y = torch.zeros(1 << 16).to("tpu")
    ckpt.restore(5, {"x": y})
    assert float(y[10]) == 10.0
    ckpt.restore(target={"x": y})
    assert float(y[10]) == 11.0
    ckpt.close()
    assert not CheckpointManager(str(tmp_path / "off"), interval=1, enable=False).save(1, {"x": x}, force=True)
    assert not (tmp_path / "off").exists()


def test_keep_latest_k(tmp_path):
    folder = tmp_path / "ckpt"
    ckpt = CheckpointManager(str(folder), interval=1, keep_latest_k=2)
    for step in range(1, 6):
        ckpt.save(step, {"v": torch.full((3,), float(step)).to("tpu"), "step": step})
    ckpt.close()
    assert ckpt.all_steps() == [4, 5]
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("step_")) == ["step_4", "step_5"]
    assert CheckpointManager(str(folder), interval=1).restore()["step"] == 5


def _saved(tmp_path, steps=(1, 2)):
    folder = tmp_path / "ckpt"
    ckpt = CheckpointManager(str(folder), interval=1)
    for s in steps:
        ckpt.save(s, {"layer": {"weight": torch.full((4, 4), float(s)).to("tpu")}, "step": s})
    ckpt.close()
    return folder


def test_corrupt_checkpoint_message(tmp_path):
    folder = _saved(tmp_path)
    for f in glob.glob(str(folder / "step_2" / "arrays" / "**" / "d" / "*"), recursive=True):
        with open(f, "wb") as fh:
            fh.write(b"garbage")
    target = {"layer": {"weight": torch.zeros(4, 4).to("tpu")}}
    with pytest.raises(CheckpointError) as info:
        CheckpointManager(str(folder), interval=1).restore(target=target)
    msg = str(info.value)
    assert str(folder / "step_2") in msg and "'weight'" in msg and "corrupt" in msg
    assert "restore(step=1)" in msg, msg
    # the previous checkpoint still restores
    CheckpointManager(str(folder), interval=1).restore(1, target)
    assert float(target["layer"]["weight"][0, 0]) == 1.0

    # a truncated manifest
    meta = folder / "step_2" / "manifest" / "metadata"
    meta.write_bytes(meta.read_bytes()[:7])
    with pytest.raises(CheckpointError, match=r"step_2 is unreadable at key manifest.*restore\(step=1\)"):
        CheckpointManager(str(folder), interval=1).restore(target=target)


def test_shape_and_dtype_mismatch_message(tmp_path):
    folder = _saved(tmp_path, steps=(1,))
    ckpt = CheckpointManager(str(folder), interval=1)
    with pytest.raises(CheckpointError) as info:
        ckpt.restore(target={"layer": {"weight": torch.zeros(4, 8).to("tpu")}})
    msg = str(info.value)
    assert "\n" not in msg
    assert "['layer']['weight']" in msg and "float32[4, 4]" in msg and "float32[4, 8]" in msg
    assert str(folder / "step_1") in msg and "matching config" in msg
    with pytest.raises(CheckpointError, match=r"\['weight'\] is float32\[4, 4\] but the target is bfloat16\[4, 4\]"):
        ckpt.restore(target={"layer": {"weight": torch.zeros(4, 4, dtype=torch.bfloat16).to("tpu")}})
    with pytest.raises(CheckpointError, match=r"has no key \['layer'\]\['bias'\]"):
        ckpt.restore(target={"layer": {"weight": torch.zeros(4, 4).to("tpu"), "bias": torch.zeros(4).to("tpu")}})
    ckpt.close()


def test_missing_folder_and_missing_step(tmp_path):
    with pytest.raises(CheckpointError, match=r"no checkpoint folder at .*nothing-here"):
        CheckpointManager(str(tmp_path / "nothing-here"), interval=1).restore()
    assert not (tmp_path / "nothing-here").exists()
    assert CheckpointManager(str(tmp_path / "nothing-here"), interval=1).latest_step() is None
    folder = _saved(tmp_path, steps=(1,))
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 9 .*available: \[1\]"):
        CheckpointManager(str(folder), interval=1).restore(9)


def test_foreign_step_directory_is_left_alone(tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "step_3").mkdir(parents=True)
    (folder / "step_3" / "model.pt").write_bytes(b"user data")
    ckpt = CheckpointManager(str(folder), interval=1, keep_latest_k=1)
    with pytest.raises(CheckpointError, match=r"holds step_3, which torchtpu did not write"):
        ckpt.save(1, {"x": torch.ones(2).to("tpu")})
    assert (folder / "step_3" / "model.pt").read_bytes() == b"user data"


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import os, torch, torchtpu
        from torchtpu.train.checkpoint.manager import CheckpointManager
        ckpt = CheckpointManager({str(folder)!r}, interval=1, async_mode="async")
        ckpt.save(1, {{"x": torch.full((4,), 1.0).to("tpu")}})
        ckpt.wait()
        ckpt.save(2, {{"x": torch.full((1 << 22,), 2.0).to("tpu")}})
        os._exit(0)   # die while step 2 is still being written in the background
    """)
    env = dict(os.environ, XLA_FLAGS=cpu_flags(8), JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, check=True, timeout=120)
    ckpt = CheckpointManager(str(folder), interval=1)
    steps = ckpt.all_steps()
    assert steps[0] == 1
    x = torch.zeros(4).to("tpu")
    ckpt.restore(1, {"x": x})
    assert x.cpu().tolist() == [1.0] * 4
    if steps == [1]:  # the crash hit mid-write: the next save at the same step works
        assert ckpt.save(2, {"x": torch.full((4,), 5.0).to("tpu")})
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
    ckpt.close()
    assert not [p for p in os.listdir(folder) if "tmp" in p]


def test_unsupported_leaf_names_key(tmp_path):
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), interval=1)
    with pytest.raises(CheckpointError, match=r"key \['sched'\]\['fn'\]: unsupported type"):
        ckpt.save(1, {"sched": {"fn": lambda s: s}}, force=True)


# ----------------------------------------------------------------------------- damaged checkpoints of a training run


def _train_argv(dump, steps, *extra):
    return debug_argv(
        dump,
        steps,
        "--validation.no-enable",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
        "--checkpoint.no-last_save_model_only",
        *extra,
        log_freq=1,
    )


def test_kill_9_mid_save_then_resume_and_corrupt_files(tmp_path):
    """A real training process is killed with SIGKILL while it writes checkpoint step_6: the next run says
    it ignored that partial save and resumes from step_4. Then a file inside the complete-looking step_6
    is truncated: resuming names it, sets it aside and falls back to step_4. A load_step that does not
    exist lists the steps that do."""
    import signal
    import time

    from torchtpu.train.config.manager import load_config
    from torchtpu.train.trainer import Trainer

    dump = tmp_path / "run"
    folder = dump / "checkpoint"
    # a 2-block copy of the debug model (in process, n_layers=2): what is checked is what a kill and a
    # damaged file do to the checkpoints, not the model's depth
    env = process_env()
    cmd = [sys.executable, "-m", "torchtpu.train", *_train_argv(dump, 6, *TWO_BLOCKS)]
    partial = []
    for _attempt in range(3):  # the save must still be in progress when the signal lands
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            partial = glob.glob(str(folder / "step_6.orbax-checkpoint-tmp*"))
            if partial:
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.002)
        out = proc.communicate(timeout=60)[0].decode()
        if partial and proc.returncode == -signal.SIGKILL and not (folder / "step_6").exists():
            break
        assert proc.returncode in (0, -signal.SIGKILL), out[-3000:]
        import shutil

        shutil.rmtree(dump)
    else:
        pytest.skip("the save finished before SIGKILL arrived, three times")
    assert (folder / "step_4").is_dir() and os.path.isdir(partial[0]), os.listdir(folder)

    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"ignoring {partial[0]}: an incomplete checkpoint" in p.stdout, p.stdout[-3000:]
    assert f"resumed from {folder / 'step_4'} (step 4)" in p.stdout, p.stdout[-3000:]
    steps_run = [json.loads(line)["step"] for line in open(dump / "metrics.jsonl")]
    assert steps_run[-2:] == [5, 6]  # the resumed run trained steps 5 and 6
    assert sorted(os.listdir(folder)) == ["step_2", "step_4", "step_6"]  # the partial save is gone

    # a complete-looking checkpoint with a damaged file
    data = max(
        (f for f in glob.glob(str(folder / "step_6" / "arrays" / "**" / "*"), recursive=True) if os.path.isfile(f)),
        key=os.path.getsize,
    )
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    cfg = load_config(_train_argv(dump, 4))
    t = Trainer(cfg, n_layers=2)
    import contextlib
    import io

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        assert t.maybe_resume()
    text = log.getvalue()
    assert f"checkpoint {folder / 'step_6'} is unreadable" in text, text
    assert f"set it aside as {folder / 'step_6.unreadable'}; falling back to the previous checkpoint, step 4" in text
    assert t.step == 4 and f"resumed from {folder / 'step_4'} (step 4)" in text
    assert sorted(os.listdir(folder)) == ["step_2", "step_4", "step_6.unreadable"]
    t.checkpointer.close()
    moments = [st["exp_avg"] for st in t.optimizer.state.values()]
    assert moments and all(float(m.abs().sum()) > 0 for m in moments)  # restored
    weights = {k: v.detach().cpu() for k, v in t.model.state_dict().items()}
    del t

    # checkpoint.exclude_from_loading: those parts are not read; the model and the step are
    cfg = load_config(_train_argv(dump, 4, "--checkpoint.exclude_from_loading", "optimizer,lr_scheduler"))
    t = Trainer(cfg, n_layers=2)
    with contextlib.redirect_stdout(io.StringIO()):
        assert t.maybe_resume()
    assert t.step == 4 and t.lr_scheduler.last_epoch == 0
    moments = [st["exp_avg"] for st in t.optimizer.state.values()]
    assert moments and all(float(m.abs().sum()) == 0 for m in moments)
    for k, v in t.model.state_dict().items():
        assert torch.equal(v.detach().cpu(), weights[k]), k
    t.checkpointer.close()
    del t

    # a load_step that does not exist
    cfg = load_config(_train_argv(dump, 4, "--checkpoint.load_step", "5"))
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 5 .*available: \[2, 4\]"):
        Trainer(cfg, n_layers=2).maybe_resume()
