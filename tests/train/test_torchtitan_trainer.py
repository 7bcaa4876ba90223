"""torchtitan 0.2.2's own trainer on tpu, unmodified: `torchrun ... -m torchtitan.train --job.config_file
llama3_debug.toml` (its llama3 debug config: fused AdamW, selective AC; 2 sequences of 256 tokens a step), started as its
README starts it, in real processes (tests/torchtitan_job.py). Nothing imports torchtpu by hand:
`import torch` finds the device through PyTorch's autoload, torchtitan's device detection picks
`tpu`, and each torchrun rank puts itself on `tpu:{LOCAL_RANK}`.

One straight 8-step run checkpoints at step 4 (torchtitan's DCP checkpointer); every other run
resumes from that checkpoint and must give the straight run's steps 5..8: eagerly in one process
(exact resume), with the compiled model and loss, and with tensor parallelism over two processes.
FSDP over two processes (another global batch) trains from scratch."""

from __future__ import annotations

import shutil

import pytest

from ..torchtitan_job import run, steps, train, workdir

CONFIG = "llama3_debug.toml"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = workdir(tmp_path_factory.mktemp("torchtitan"))
    losses = train(root, CONFIG, "--checkpoint.enable", "--checkpoint.interval", "4", "--job.dump_folder", "straight")
    return root, losses


def _resumed(root, name, *overrides, nproc=1):
    """Steps 5..8 of a run that starts from the straight run's step-4 checkpoint."""
    ckpt = root / name / "checkpoint"
    ckpt.mkdir(parents=True)
    shutil.copytree(root / "straight" / "checkpoint" / "step-4", ckpt / "step-4")
    return train(root, CONFIG, "--checkpoint.enable", "--job.dump_folder", name, *overrides, nproc=nproc)


def _close(got: dict, want: dict, steps, tol: float):
    for s in steps:
        assert abs(got[s] - want[s]) <= tol * abs(want[s]), (s, got, want)


def test_one_process_trains(straight):
    _, losses = straight
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1] - 1.5, losses


def test_resume_from_dcp_checkpoint_gives_the_straight_run(straight):
    root, want = straight
    got = _resumed(root, "resumed")
    assert sorted(got) == [5, 6, 7, 8], got
    _close(got, want, range(5, 9), 1e-5)


def test_compiled_model_and_loss_give_eager_losses(straight):
    root, want = straight
    got = _resumed(root, "compiled", "--compile.enable", "--compile.backend", "tpu")
    _close(got, want, range(5, 9), 1e-4)


def test_tensor_parallel_over_two_processes_gives_one_process_losses(straight):
    root, want = straight
    ckpt = root / "tp2" / "checkpoint"
    ckpt.mkdir(parents=True)
    shutil.copytree(root / "straight" / "checkpoint" / "step-4", ckpt / "step-4")
    flags = ("--checkpoint.enable", "--job.dump_folder", "tp2", "--parallelism.tensor_parallel_degree", "2")
    records = steps(run(root, CONFIG, *flags, nproc=2))
    _close({s: r["loss"] for s, r in records.items()}, want, range(5, 9), 2e-3)
    # the device memory torchtitan reports stays flat: a collective's Work left registered with
    # PyTorch's functional collectives kept its output arrays, one more each step
    assert records[8]["memory"] == records[5]["memory"], records


def test_fsdp_over_two_processes_trains(straight):
    root, _ = straight
    got = train(root, CONFIG, "--training.steps", "3", "--job.dump_folder", "fsdp2", nproc=2)
    assert sorted(got) == [1, 2, 3]
    assert got[3] < got[1] - 0.25, got


@pytest.mark.parametrize("experts, ranks", [(4, 1), (8, 2), (3, 4)])
def test_moe_permutation_on_tpu_equals_torchtitan_s_cpu_reference(experts, ranks):
    """torchtitan's MoE token permutation, its Triton kernel on CUDA, runs as tensor ops on tpu."""
    import torch
    from torchtitan.models.moe.kernels import generate_permute_indices

    import torchtpu  # noqa: F401  (installs the replacement: torchtitan's module is imported already)

    torch.manual_seed(experts * ranks)
    counts = torch.randint(0, 7, (experts * ranks,), dtype=torch.int64)
    counts[1] = 0  # an expert with no tokens from one rank
    align = 8
    max_len = int(counts.sum()) + (experts + 1) * align
    want = generate_permute_indices(counts, experts, ranks, max_len, align, use_cpu=True)
    got = generate_permute_indices(counts.to("tpu"), experts, ranks, max_len, align)
    for g, w in zip(got, want):
        assert g.device.type == "tpu"
        assert torch.equal(g.cpu(), w), (g.cpu(), w)


@pytest.fixture(scope="module")
def family_root(tmp_path_factory):
    return workdir(tmp_path_factory.mktemp("families"))


@pytest.mark.parametrize("name, flavor", [("deepseek_v3", "debugmodel"), ("llama4", "debugmodel")])
def test_families_train_under_torchtitan_s_trainer(family_root, name, flavor):
    """torchtitan's MoE families at their shipped debug flavors (DeepSeek-V3's MLA and shared experts,
    Llama 4's interleaved MoE), one sequence per step to keep the suite's time."""
    overrides = ["--model.name", name, "--model.flavor", flavor, "--training.local_batch_size", "1"]
    got = train(family_root, CONFIG, *overrides, "--training.steps", "2", "--job.dump_folder", name)
    assert sorted(got) == [1, 2], got
    assert got[2] < got[1], got
