"""python -m torchtpu.generate: prefill + KV-cache decode on the job's mesh, against transformers'
greedy `generate` on the same Hugging Face weights (CPU)."""

from __future__ import annotations

import os

import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.train.config.manager import load_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBUG_TOML = os.path.join(REPO, "train_configs", "debug_model.toml")
PROMPT = "Once upon a time there was a"
NEW = 16


# the trainer sets the process's current device mesh
pytestmark = pytest.mark.usefixtures("keep_current_mesh")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """torchtitan debugmodel weights (its own init, seed 0) as a Hugging Face folder."""
    from torchtitan.models.llama3 import Transformer, llama3_args

    from torchtpu.train.checkpoint.hf import save_hf

    args = llama3_args["debugmodel"]
    torch.manual_seed(0)
    m = Transformer(args)
    with torch.no_grad():
        m.init_weights()
    sd = m.state_dict()
    folder = tmp_path_factory.mktemp("gen") / "hf"
    return save_hf(folder, [(k, tuple(v.shape)) for k, v in sd.items()], lambda n: sd[n], args, torch.float32)


def _prompt_ids():
    from torchtpu.train.tokenizer import build_tokenizer

    return build_tokenizer(None).encode(PROMPT, bos=True, eos=False)


@pytest.fixture(scope="module")
def reference(hf_folder):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(hf_folder, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # exactly NEW tokens, as torchtpu.generate returns
    ids = _prompt_ids()
    with torch.no_grad():
        x = torch.tensor([ids])
        # an explicit all-ones mask: otherwise transformers masks every prompt token equal to the pad id
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    "layout", [("fsdp8", []), ("tp2_fsdp4", ["--parallelism.tensor_parallel_degree", "2"])], ids=lambda x: x[0]
)
def test_greedy_equals_transformers(hf_folder, reference, layout):
    from torchtpu.generate import generate, load_for_generation

    cfg = load_config(["--config", DEBUG_TOML, *layout[1]])
    ids = _prompt_ids()
    model, mesh, _ = load_for_generation(cfg, hf_folder, len(ids) + NEW)
    got = generate(model, mesh, ids, NEW, temperature=0.0)
    print(f"{layout[0]} torchtpu     {got}\n{layout[0]} transformers {reference}")
    assert len(got) == NEW
    assert got == reference


def test_cli_prints_prompt_and_continuation_and_top1_sampling_is_greedy(hf_folder, reference, capsys):
    from torchtpu.generate import main
    from torchtpu.train.tokenizer import build_tokenizer

    tok = build_tokenizer(None)
    # top-k 1 leaves one candidate: sampling at any temperature must give the greedy tokens
    assert (
        main(
            [
                "--config",
                DEBUG_TOML,
                "--checkpoint",
                str(hf_folder),
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                str(NEW),
                "--temperature",
                "0.7",
                "--top-k",
                "1",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.strip().splitlines()[-1]
    cont = reference[: reference.index(tok.eos_id)] if tok.eos_id in reference else reference
    assert out == (PROMPT + tok.decode(cont)).strip().splitlines()[-1]


def test_sampling_depends_on_seed_and_repeats(hf_folder):
    from torchtpu.generate import generate, load_for_generation

    cfg = load_config(["--config", DEBUG_TOML])
    ids = _prompt_ids()
    model, mesh, _ = load_for_generation(cfg, hf_folder, len(ids) + NEW)
    runs = []
    for seed in (1, 1, 2):
        torch.tpu.manual_seed_all(seed)
        runs.append(generate(model, mesh, ids, NEW, temperature=1.0))
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert all(0 <= t < 2048 for t in runs[2])


def test_cli_on_a_folder_without_checkpoints_is_one_line_and_touches_nothing(tmp_path):
    """A folder with no finished checkpoint: exit 2 with one line naming the fix, nothing else on
    stderr (no clean-up thread of Orbax's left behind at exit), and a save another job has in flight
    (Orbax's temporary step folder) is left where it is: a reader never cleans up a writer's files."""
    import subprocess
    import sys

    in_flight = tmp_path / "step_3.orbax-checkpoint-tmp-1234"
    in_flight.mkdir()
    (in_flight / "part").write_text("being written")
    p = subprocess.run(
        [sys.executable, "-m", "torchtpu.generate", "--config", DEBUG_TOML, "--checkpoint", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "no checkpoint (step_N folder) in it" in lines[0], p.stderr
    assert (in_flight / "part").read_text() == "being written"
