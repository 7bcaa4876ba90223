"""The serving dry run (torchtpu/serve/dry_run.py): vLLM's step compiled for a TPU topology.

A 2-layer Llama (head dim 128, so the Pallas ragged paged attention kernel takes it) on v5e:2x2
with tensor parallelism 4, in a process of its own (vLLM's distributed state is per process).
Its figures are checked against arithmetic on the config: the weights per chip are the split
parameters' bytes over 4 plus the replicated ones, the parameter count is the config's, and the
KV cache capacity is what the HBM left holds at the per-token size of the cache layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torchtpu.distributed.topology import libtpu_available
from torchtpu.hardware import CHIPS

pytestmark = pytest.mark.skipif(not libtpu_available(), reason="libtpu is not installed")

DIM, LAYERS, HEADS, KV_HEADS, VOCAB, FFN = 512, 2, 4, 4, 2048, 1536
TP, BLOCK, MAX_LEN, BATCH, CONTEXT = 4, 32, 256, 8, 128


def _folder(folder):
    pytest.importorskip("vllm")
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    from torchtpu.models.llama3.hf import hf_config

    args = TransformerModelArgs(dim=DIM, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=VOCAB)
    cfg = hf_config(args, "bfloat16")
    assert cfg["intermediate_size"] == FFN
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def test_dry_run_of_a_two_layer_llama_on_v5e_tp4(tmp_path):
    folder = _folder(tmp_path / "model")
    out = tmp_path / "figures.json"
    cmd = [sys.executable, "-m", "torchtpu.serve.dry_run", "--model", folder, "--topology", "v5e:2x2"]
    cmd += ["--tensor-parallel-size", str(TP), "--max-model-len", str(MAX_LEN), "--batch", str(BATCH)]
    cmd += ["--context", str(CONTEXT), "--prefill-tokens", "64", "--block-size", str(BLOCK), "--json", str(out)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    for line in ("weights / chip", "KV cache / chip", "concurrent sequences", "decode step", "HBM roofline"):
        assert line in text, f"no {line!r} line in:\n{text}"
    assert "output tokens/s / chip" in text and "prefill step" in text
    assert "Pallas ragged paged attention kernel" in text
    f = json.loads(out.read_text())

    # parameters: the config's count; the per-chip bytes are the split ones over TP plus the replicated
    head = DIM // HEADS
    layer = DIM * (HEADS + 2 * KV_HEADS) * head + HEADS * head * DIM + 3 * DIM * FFN + 2 * DIM
    count = 2 * VOCAB * DIM + LAYERS * layer + DIM
    assert f["parameters_split"] + f["parameters_replicated"] == count
    assert f["parameters_replicated"] == (2 * LAYERS + 1) * DIM  # the RMSNorm weights
    assert f["weight_bytes_per_chip"] == 2 * (f["parameters_split"] // TP + f["parameters_replicated"])

    # the KV cache: K and V of the chip's kv heads, head dim 128, bf16, every layer
    per_token = LAYERS * 2 * (KV_HEADS // TP) * 128 * 2
    assert f["kv_bytes_per_token_per_chip"] == per_token
    room = CHIPS["v5e"].hbm_bytes * 0.9 - f["weight_bytes_per_chip"] - f["scratch_bytes_per_chip"]
    assert f["kv_cache_tokens_per_chip"] == int(room // (per_token * BLOCK)) * BLOCK
    assert f["concurrent_sequences_at_max_model_len"] == f["kv_cache_tokens_per_chip"] // MAX_LEN

    # the decode step: XLA's estimate exists (the program is costed whole), the roofline is the
    # weights it reads (all but the embedding table) plus its sequences' cache over the bandwidth
    assert f["pallas_attention"]
    assert f["decode_estimate_seconds"] and f["decode_estimate_seconds"] > 0
    embedding = VOCAB * DIM * 2 // TP
    assert f["decode_weight_read_bytes_per_chip"] == f["weight_bytes_per_chip"] - embedding
    assert f["decode_kv_read_bytes_per_chip"] == BATCH * CONTEXT * per_token
    bw = CHIPS["v5e"].hbm_bandwidth
    assert f["decode_roofline_seconds"] == pytest.approx(
        (f["decode_weight_read_bytes_per_chip"] + BATCH * CONTEXT * per_token) / bw
    )
    assert f["output_tokens_per_s_per_chip"] == pytest.approx(BATCH / f["decode_estimate_seconds"] / TP)
    assert f["prefill_estimate_seconds"] and f["prefill_estimate_seconds"] > 0
