"""torchtpu-convert: every format in and out, checked against the writers' own readers
(PyTorch's DCP, torch.load, safetensors, transformers) rather than against the converter."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def titan_state():
    """A torchtitan debugmodel's state dict on the CPU, as a torchtitan run would hold it."""
    from torchtitan.models.llama3 import Transformer, llama3_args

    torch.manual_seed(0)
    m = Transformer(llama3_args["debugmodel"])
    with torch.no_grad():
        m.init_weights()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def convert(*argv):
    from torchtpu.convert import main

    assert main([str(a) for a in argv]) == 0


def clean_python(code: str, *args) -> None:
    """Run `code` in a fresh interpreter without torchtpu imported (as a torchtitan job would be)."""
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


_TITAN_DCP_SAVE = """
import sys, torch, torch.distributed.checkpoint as dcp
sd = torch.load(sys.argv[1], weights_only=True)
dcp.save(sd, checkpoint_id=sys.argv[2])   # no process group
"""

_TITAN_DCP_LOAD = """
import sys, torch, torch.distributed.checkpoint as dcp
like = torch.load(sys.argv[1], weights_only=True)
out = {k: torch.empty_like(v) for k, v in like.items()}
dcp.load(out, checkpoint_id=sys.argv[2])
torch.save(out, sys.argv[3])
"""


def test_dcp_to_torchtpu_and_back(tmp_path, titan_state):
    """A checkpoint written by PyTorch's DCP from a torchtitan Transformer state dict (in a process
    without torchtpu) converts to a torchtpu checkpoint and back to DCP with equal tensors, read
    back by DCP in a process without torchtpu; the torchtpu checkpoint holds them too."""
    from torchtpu.train.checkpoint.manager import CheckpointManager

    torch.save(titan_state, tmp_path / "ref.pt")
    clean_python(_TITAN_DCP_SAVE, tmp_path / "ref.pt", tmp_path / "titan")
    convert(tmp_path / "titan", tmp_path / "tpu", "--to", "torchtpu", "--flavor", "debugmodel", "--step", "7")
    assert sorted(os.listdir(tmp_path / "tpu")) == ["step_7"]
    ck = CheckpointManager(tmp_path / "tpu", interval=1, async_mode="sync")
    restored = ck.restore(7)
    ck.close()
    assert restored["model_only"] is True and restored["step"] == 7
    assert sorted(restored["model"]) == sorted(titan_state)
    for k, v in titan_state.items():
        got = restored["model"][k]
        assert torch.equal(torch.from_numpy(np.asarray(got)) if not isinstance(got, torch.Tensor) else got.cpu(), v), k

    convert(tmp_path / "tpu", tmp_path / "back", "--to", "dcp", "--flavor", "debugmodel")
    clean_python(_TITAN_DCP_LOAD, tmp_path / "ref.pt", tmp_path / "back", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    for k, v in titan_state.items():
        assert torch.equal(back[k], v), k


def test_torch_hf_dcp_torch_roundtrip_and_bf16(tmp_path, titan_state):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    torch.save(titan_state, tmp_path / "sd.pt")
    convert(
        tmp_path / "sd.pt", tmp_path / "hf", "--to", "hf", "--flavor", "debugmodel", "--max-shard-size", str(2 << 20)
    )
    files = sorted(os.listdir(tmp_path / "hf"))
    assert "model.safetensors.index.json" in files and "config.json" in files
    # the tokenizer (bundled by default) and its ids: transformers encodes as torchtpu-train does
    assert {"generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    from transformers import AutoTokenizer

    from torchtpu.train.tokenizer import build_tokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("a dog")["input_ids"] == build_tokenizer(None).encode(
        "a dog", bos=True, eos=False
    )
    # transformers reads it, and its logits are those of the torchtitan model
    from torchtitan.models.llama3 import Transformer, llama3_args

    ref_model = Transformer(llama3_args["debugmodel"])
    ref_model.load_state_dict(titan_state)
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    x = torch.randint(0, 2048, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(x).logits - ref_model(x)).abs().max().item()
    print(f"transformers vs torchtitan logits: {diff:.2e}")
    assert diff <= 1e-4

    convert(tmp_path / "hf", tmp_path / "dcp", "--to", "dcp", "--flavor", "debugmodel")
    convert(tmp_path / "dcp", tmp_path / "out.pt", "--to", "torch", "--flavor", "debugmodel")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert sorted(out) == sorted(titan_state)
    for k, v in titan_state.items():
        assert torch.equal(out[k], v), k

    convert(tmp_path / "sd.pt", tmp_path / "hf16", "--to", "hf", "--flavor", "debugmodel", "--dtype", "bfloat16")
    # an HF source passes its own tokenizer on; --tokenizer none writes none
    convert(tmp_path / "hf", tmp_path / "hf_again", "--to", "hf", "--flavor", "debugmodel")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (tmp_path / "hf_again" / name).read_bytes(), name
    convert(tmp_path / "hf", tmp_path / "bare", "--to", "hf", "--flavor", "debugmodel", "--tokenizer", "none")
    assert sorted(os.listdir(tmp_path / "bare")) == ["config.json", "model.safetensors"]
    w = load_file(tmp_path / "hf16" / "model.safetensors")
    assert w["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(w["model.embed_tokens.weight"], titan_state["tok_embeddings.weight"].to(torch.bfloat16))


def test_wrong_flavor_is_one_line_error(tmp_path, titan_state, capsys):
    from torchtpu.convert import main

    torch.save(titan_state, tmp_path / "sd.pt")
    assert main([str(tmp_path / "sd.pt"), str(tmp_path / "x"), "--to", "hf", "--flavor", "8B"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("torchtpu-convert:")]
    print(err)
    assert len(err) == 1
    err = err[0]
    assert "tok_embeddings.weight" in err and "[2048, 256]" in err and "--flavor" in err


def test_module_entry_point_runs():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-m", "torchtpu.convert", "--help"], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "--to" in r.stdout and "dcp" in r.stdout
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        assert 'torchtpu-convert = "torchtpu.convert:main"' in f.read()
