"""[validation]: held-out loss and perplexity during training (torchtpu.train.validate).

Real torchtitan debug model, real bundled corpus (its held-out split), the compiled forward-only
program over the same sharded parameters as training. The CPU (plain PyTorch on the trainer's
weights, the same held-out batches) is the oracle for the value.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math

import numpy as np
import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.train.config.job_config import ConfigError
from torchtpu.train.config.manager import load_config

from .debug_run import debug_argv

# the trainer sets the process's current device mesh
pytestmark = pytest.mark.usefixtures("keep_current_mesh")

# the jobs train a 2-block copy of the debug model, and the CPU oracle is the same 2 blocks: what is
# checked (the held-out batches, the forward-only program, its value) does not depend on the depth
N_LAYERS = 2


def argv(dump, *extra):
    return debug_argv(
        dump,
        8,
        "--validation.seq_len",
        "32",
        "--validation.local_batch_size",
        "1",
        "--validation.freq",
        "4",
        *extra,
        log_freq=4,
        warmup_steps=2,
    )


def cpu_validation_loss(cfg, model, batches, dp=8):
    """Plain PyTorch on the CPU: the trainer's current weights, the first `batches` held-out batches."""
    from torchtitan.models.llama3 import Transformer

    from torchtpu.train.data import build_global_batch_loader
    from torchtpu.train.loss import cross_entropy_loss
    from torchtpu.train.model_builder import build_model_args
    from torchtpu.train.tokenizer import build_tokenizer

    tok = build_tokenizer(None)
    ref = Transformer(dataclasses.replace(build_model_args(cfg, tok.vocab_size), n_layers=N_LAYERS))
    state = {n.replace("_checkpoint_wrapped_module.", ""): p.detach().cpu() for n, p in model.named_parameters()}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and all("freqs_cis" in k for k in missing)
    v = cfg.validation
    loader = build_global_batch_loader(
        v.dataset, v.dataset_path, tok, v.seq_len, v.local_batch_size * dp, infinite=v.steps != -1
    )
    losses = []
    with torch.no_grad():
        for _ in range(batches):
            x, y = next(loader)
            losses.append(cross_entropy_loss(ref(torch.from_numpy(x)), torch.from_numpy(y)).item())
    return sum(losses) / len(losses)


def test_validation_logs_a_falling_loss_that_matches_the_cpu(tmp_path):
    """FSDP over 8 devices: validation at steps 1, 4, 8 to the console, metrics.jsonl and TensorBoard; the
    whole held-out split (steps = -1); the value equals the CPU oracle's on the same weights and batches."""
    from torchtpu.train.documents import BUNDLED_VALIDATION_DOCS
    from torchtpu.train.trainer import Trainer

    cfg = load_config(argv(tmp_path, "--metrics.enable_tensorboard"))
    assert cfg.validation.enable and cfg.validation.dataset == "bundled_validation" and cfg.validation.steps == -1
    t = Trainer(cfg, n_layers=N_LAYERS)
    hist = t.train()
    val = {h["step"]: h for h in hist if "validation/loss" in h}
    assert sorted(val) == [1, 4, 8], hist
    losses = [val[s]["validation/loss"] for s in (1, 4, 8)]
    assert losses[2] < losses[1] < losses[0], losses
    for h in val.values():
        assert h["validation/perplexity"] == pytest.approx(math.exp(h["validation/loss"]), rel=1e-9)
    # the whole held-out split: every complete batch of 8 rows x 33 tokens, row r being the documents at
    # positions r, r + 8, ... of the split in its seed-0 epoch-0 order; the row with the fewest windows decides
    import numpy as np

    from torchtpu.train.documents import bundled_documents

    docs = bundled_documents("validation")
    order = np.random.default_rng([0, 0]).permutation(len(docs))
    row_tokens = [
        sum(len(t.tokenizer.encode(docs[order[i]], bos=True, eos=True)) for i in range(r, len(docs), 8))
        for r in range(8)
    ]
    n = val[8]["validation/batches"]
    assert len(docs) == BUNDLED_VALIDATION_DOCS
    assert n == t.validator.num_batches == min(row_tokens) // 33 > 1
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    logged = {r["step"]: r["validation/loss"] for r in records if "validation/loss" in r}
    assert logged == {s: pytest.approx(val[s]["validation/loss"]) for s in (1, 4, 8)}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(str(tmp_path / "tb" / "events.*"))
    acc = EventAccumulator(events)
    acc.Reload()
    assert [e.step for e in acc.Scalars("validation/loss")] == [1, 4, 8]
    # the oracle: the same held-out batches through plain PyTorch on the CPU with the final weights
    again = t.validator.validate()["validation/loss"]
    assert again == pytest.approx(losses[2], rel=1e-6)  # the same batches every evaluation
    assert again == pytest.approx(cpu_validation_loss(cfg, t.model, n), rel=2e-5)
    assert t.validator.eval_fn.stats.traces == 1  # one forward-only program, compiled once


def test_validation_under_tensor_parallelism_and_fixed_steps(tmp_path):
    """TP2 x FSDP4 with loss parallelism, validation.steps = 3 batches: the same value as the CPU."""
    from torchtpu.train.trainer import Trainer

    cfg = load_config(
        argv(
            tmp_path,
            "--parallelism.tensor_parallel_degree",
            "2",
            "--validation.steps",
            "3",
            "--training.steps",
            "2",
            "--validation.freq",
            "100",
        )
    )
    t = Trainer(cfg, n_layers=N_LAYERS)
    hist = t.train()
    assert [h["step"] for h in hist if "validation/loss" in h] == [1]  # torchtitan: step 1, then every freq
    assert t.validator.num_batches == 3
    got = t.validator.validate()
    assert t.dims.dp == 4 and got["validation/batches"] == 3 and got["validation/tokens"] == 3 * 4 * 32
    assert got["validation/loss"] == pytest.approx(cpu_validation_loss(cfg, t.model, 3, dp=4), rel=2e-5)


def test_validation_errors_name_the_key(tmp_path):
    from torchtpu.train.trainer import Trainer

    # more tokens per batch than the held-out split holds
    cfg = load_config(argv(tmp_path, "--validation.seq_len", "4096", "--validation.local_batch_size", "64"))
    with pytest.raises(ConfigError, match=r"\[validation\].*fewer tokens than one validation batch"):
        Trainer(cfg)
    cfg = load_config(argv(tmp_path, "--validation.dataset", "nonsense"))
    with pytest.raises(ConfigError, match=r"\[validation\] dataset = 'nonsense'.*bundled_validation"):
        Trainer(cfg)


def test_held_out_split_is_disjoint_from_training():
    """The training loader's documents (what it tokenizes) never include a held-out document, the two
    splits together are the whole corpus, and the split does not depend on the seed."""
    import re

    from torchtpu.train.data import build_dataloader
    from torchtpu.train.documents import BUNDLED_CORPUS, BUNDLED_VALIDATION_DOCS
    from torchtpu.train.tokenizer import build_tokenizer

    tok = build_tokenizer(None)
    with open(BUNDLED_CORPUS, encoding="utf-8") as f:
        corpus = [d.strip() for d in re.split(r"\n\s*\n", f.read()) if d.strip()]
    seen_train, seen_val = [], []
    for seed in (0, 7):
        train = build_dataloader("bundled", None, tok, 16, 1, 0, 1, seed=seed)
        val = build_dataloader("bundled_validation", None, tok, 16, 1, 0, 1, seed=seed)
        for epoch in (0, 1):
            seen_train.append({text for _, text in train.source.documents(epoch, 0)})
        seen_val.append({text for _, text in val.source.documents(0, 0)})
    assert all(s == seen_train[0] for s in seen_train) and seen_val[0] == seen_val[1]
    assert 0.9 * BUNDLED_VALIDATION_DOCS <= len(seen_val[0]) <= BUNDLED_VALIDATION_DOCS  # a few repeat
    assert not seen_train[0] & seen_val[0]
    assert seen_train[0] | seen_val[0] == set(corpus)
    # and the packed token stream of a whole training epoch is made of training documents only
    train = build_dataloader("bundled", None, tok, 255, 1, 0, 1, infinite=False)
    stream = np.concatenate([np.concatenate([x[0], y[0, -1:]]) for x, y in train])
    held = [np.asarray(tok.encode(d, bos=True, eos=True)) for d in sorted(seen_val[0])[:20]]
    text = stream.tobytes()
    for ids in held:
        assert ids.astype(np.int64).tobytes() not in text
