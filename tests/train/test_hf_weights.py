"""Hugging Face safetensors in and out of torchtpu-train (torchtpu.train.checkpoint.hf).

The oracle is code nobody here wrote: `transformers.LlamaForCausalLM` on the CPU reads the folder
the trainer exports, and torchtitan's state-dict adapter defines names and the q/k permutation.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.train.config.job_config import ConfigError
from torchtpu.train.config.manager import load_config

from ..processes import cpu_flags, free_port, run_together
from .debug_run import DEBUG_TOML, REPO, debug_argv

SEQ, STEPS = 32, 3


def argv(dump, *extra):
    # no held-out evaluation (the debug config's [validation] runs at step 1): these jobs are about weights
    return debug_argv(dump, STEPS, "--validation.no-enable", *extra, seq_len=SEQ, log_freq=1, warmup_steps=2)


# the trainer sets the process's current device mesh
pytestmark = pytest.mark.usefixtures("keep_current_mesh")


def _tokens(batch=8, n=16, seed=3):
    return torch.randint(0, 2048, (batch, n), generator=torch.Generator().manual_seed(seed))


def _logits(trainer, tokens, on_one_device=False):
    """The trainer model's logits for `tokens` (laid out over the data-parallel axes, or on one
    device for a model whose parameters are whole on one device), on the CPU."""
    from torchtpu.distributed import distribute_tensor
    from torchtpu.models.llama3.parallelize import batch_placements

    if on_one_device:
        x = tokens.to("tpu")
    else:
        x = distribute_tensor(tokens, trainer.mesh, batch_placements(trainer.mesh))
    with torch.no_grad():
        out = trainer.model(x)
    return out.cpu()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Run A: STEPS steps of the debug model, final weights exported with last_save_in_hf; then one
    more step of A on the batch a new job sees first (the data position reset to the start)."""
    import copy

    from torchtpu.train.trainer import Trainer

    dump = tmp_path_factory.mktemp("hf_export")
    cfg = load_config(
        argv(
            dump,
            "--checkpoint.enable",
            "--checkpoint.interval",
            "100",
            "--checkpoint.last_save_model_only",
            "--checkpoint.last_save_in_hf",
        )
    )
    a = Trainer(cfg)
    data_start = copy.deepcopy(a.dataloader.state_dict())
    a.train()
    folder = os.path.join(dump, "checkpoint", f"hf_step_{STEPS}")
    logits = _logits(a, _tokens())
    # the exporting run's next step, on the first batch of the data (what a new job reads first)
    a.dataloader.load_state_dict(data_start)
    a.checkpointer = None  # this extra step is not part of the saved job
    a.cfg.training.steps = STEPS + 1
    a.train()
    return {"folder": folder, "logits": logits, "next_loss": a.history[-1]["loss"], "dump": dump}


def test_export_loads_in_transformers_and_logits_match(exported):
    from transformers import LlamaForCausalLM

    folder = exported["folder"]
    assert sorted(os.listdir(folder)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        ref = hf(_tokens()).logits
    got = exported["logits"]
    diff = (got - ref).abs().max().item()
    print(f"max |torchtpu - transformers| logits = {diff:.2e}")
    assert got.shape == ref.shape == (8, 16, 2048)
    assert diff <= 1e-4


PROMPT, NEW = "Once upon a time there was a", 16


def test_export_carries_its_tokenizer_and_greedy_text_agrees(exported, capsys):
    """With no tokenizer path given, transformers reads the export's tokenizer and special-token
    ids, encodes a prompt as torchtpu-train does (BOS first), and its greedy continuation is the
    one `python -m torchtpu.generate` prints from the same folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchtpu.generate import main
    from torchtpu.train.tokenizer import build_tokenizer

    folder = exported["folder"]
    ours = build_tokenizer(None)  # the debug job's tokenizer (bundled)
    ids = {"bos_token_id": ours.bos_id, "eos_token_id": ours.eos_id, "pad_token_id": ours.pad_id}
    assert ids == {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}
    config = json.load(open(os.path.join(folder, "config.json")))
    assert {k: config.get(k) for k in ids} == ids
    assert json.load(open(os.path.join(folder, "generation_config.json"))) == ids

    tok = AutoTokenizer.from_pretrained(folder)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 1)
    enc = tok(PROMPT, return_tensors="pt")
    assert enc["input_ids"][0].tolist() == ours.encode(PROMPT, bos=True, eos=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        out = hf.generate(**enc, max_new_tokens=NEW, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    expected = PROMPT + tok.decode(new, skip_special_tokens=True)

    argv = ["--config", DEBUG_TOML, "--checkpoint", folder, "--prompt", PROMPT, "--max-new-tokens", str(NEW)]
    code = main([*argv, "--temperature", "0"])
    printed = capsys.readouterr().out
    print(f"transformers: {expected!r}\ntorchtpu.generate: {printed.splitlines()[-1]!r}")
    assert code == 0
    assert printed.endswith(expected + "\n")


def test_export_copies_a_jobs_own_tokenizer_files(tmp_path):
    """A job whose hf_assets_path is a Hugging Face tokenizer folder exports that tokenizer: its
    tokenizer_config.json and chat template as they are, its pad token named in config.json."""
    import shutil

    from transformers import AutoTokenizer

    from torchtpu.train.tokenizer import BUNDLED_TOKENIZER, build_tokenizer

    assets = tmp_path / "assets"
    assets.mkdir()
    shutil.copyfile(BUNDLED_TOKENIZER, assets / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "pad_token": "<|begin_of_text|>",
    }
    (assets / "tokenizer_config.json").write_text(json.dumps(config))
    (assets / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    tok = build_tokenizer(str(assets))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 0)
    folder = _write_folder(tmp_path / "hf", _debug_args(), tokenizer=tok)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        assert (assets / name).read_bytes() == open(os.path.join(folder, name), "rb").read(), name
    assert json.load(open(os.path.join(folder, "config.json")))["pad_token_id"] == 0
    hf_tok = AutoTokenizer.from_pretrained(folder)
    assert hf_tok("a cat")["input_ids"] == tok.encode("a cat", bos=True, eos=False)
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "hi\n"


def test_import_first_loss_equals_exporting_runs_next_loss(exported, tmp_path):
    from torchtpu.train.trainer import Trainer

    cfg = load_config(
        argv(
            tmp_path,
            "--training.steps",
            "1",
            "--checkpoint.initial_load_path",
            exported["folder"],
            "--checkpoint.initial_load_in_hf",
        )
    )
    c = Trainer(cfg)
    hist = c.train()
    print(f"imported job's first loss {hist[0]['loss']!r}, exporting job's next loss {exported['next_loss']!r}")
    # Same weights (the fp32 round trip is exact: test_weights_roundtrip_exactly), same batch (both read
    # the data from position 0), same job config. The two jobs' programs differ (the imported job's
    # starts from step 0's state, the exporting one's from a resumed step), so XLA's fusion may move the
    # last bits: equal to fp32 rounding.
    assert hist[0]["loss"] == pytest.approx(exported["next_loss"], rel=1e-6, abs=0)


def test_weights_roundtrip_exactly(exported, tmp_path):
    """HF folder -> model (FSDP8) -> HF folder: every tensor bit-identical (fp32)."""
    from safetensors.torch import load_file

    from torchtpu.train.checkpoint.hf import save_model_as_hf
    from torchtpu.train.trainer import Trainer

    cfg = load_config(
        argv(tmp_path, "--checkpoint.initial_load_path", exported["folder"], "--checkpoint.initial_load_in_hf")
    )
    t = Trainer(cfg)
    t.maybe_resume()
    out = save_model_as_hf(tmp_path / "again", t.model, t.model_args, torch.float32, max_shard_bytes=1 << 20)
    files = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) > 2
    a = load_file(os.path.join(exported["folder"], "model.safetensors"))
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    b = {}
    for f in set(index["weight_map"].values()):
        b.update(load_file(os.path.join(out, f)))
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(
    "layout", [("fsdp8", []), ("tp2_fsdp4", ["--parallelism.tensor_parallel_degree", "2"])], ids=lambda x: x[0]
)
def test_sharded_load_matches_unsharded(exported, tmp_path, layout):
    from torchtpu.train.trainer import Trainer

    name, extra = layout
    base = ["--checkpoint.initial_load_path", exported["folder"], "--checkpoint.initial_load_in_hf"]
    ref_t = Trainer(
        load_config(
            argv(
                tmp_path / "rep",
                *base,
                "--parallelism.data_parallel_replicate_degree",
                "8",
                "--parallelism.data_parallel_shard_degree",
                "1",
            )
        )
    )
    ref_t.maybe_resume()
    p = dict(ref_t.model.named_parameters())["layers.0.attention.wq.weight"]
    assert torchtpu.to_jax(p).sharding.is_fully_replicated  # pure data parallel: whole parameters
    ref = _logits(ref_t, _tokens(), on_one_device=True)
    del ref_t
    t = Trainer(load_config(argv(tmp_path / name, *base, *extra)))
    t.maybe_resume()
    wq = torchtpu.to_jax(dict(t.model.named_parameters())["layers.0.attention.wq.weight"])
    assert not wq.sharding.is_fully_replicated  # really sharded
    got = _logits(t, _tokens())
    assert got.shape == ref.shape == (8, 16, 2048)
    diff = (got - ref).abs().max().item()
    print(f"{name}: max |sharded - unsharded| logits = {diff:.2e}")
    assert diff <= 1e-5


def _debug_args():
    from torchtitan.models.llama3 import llama3_args

    return llama3_args["debugmodel"]


def _write_folder(folder, model_args, max_shard_bytes=None, seed=0, tokenizer=None):
    """A Hugging Face folder of random weights for `model_args`, written tensor by tensor."""
    from torchtitan.models.llama3 import Transformer

    from torchtpu.train.checkpoint.hf import save_hf

    with torch.device("meta"):
        m = Transformer(model_args)
    entries = [(k, tuple(v.shape)) for k, v in m.state_dict().items()]
    g = torch.Generator().manual_seed(seed)
    kw = {"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}
    return save_hf(
        folder,
        entries,
        lambda n: torch.randn(dict(entries)[n], generator=g) * 0.02,
        model_args,
        torch.float32,
        tokenizer=tokenizer,
        **kw,
    )


def test_vocab_and_shape_mismatch_are_one_line_config_errors(tmp_path):
    import dataclasses

    from torchtitan.models.llama3 import llama3_args

    from torchtpu.train.trainer import Trainer

    big_vocab = _write_folder(tmp_path / "vocab", dataclasses.replace(llama3_args["debugmodel"], vocab_size=4096))
    with pytest.raises(ConfigError) as e:
        Trainer(
            load_config(
                argv(tmp_path / "a", "--checkpoint.initial_load_path", big_vocab, "--checkpoint.initial_load_in_hf")
            )
        ).maybe_resume()
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg
    assert "model.embed_tokens.weight" in msg and "[4096, 256]" in msg and "[2048, 256]" in msg
    assert "vocabulary" in msg and "initial_load_path" in msg

    wide = _write_folder(tmp_path / "wide", dataclasses.replace(llama3_args["debugmodel"], dim=512, n_heads=16))
    with pytest.raises(ConfigError) as e:
        Trainer(
            load_config(argv(tmp_path / "b", "--checkpoint.initial_load_path", wide, "--checkpoint.initial_load_in_hf"))
        ).maybe_resume()
    msg = str(e.value)
    print(msg)
    assert "\n" not in msg
    assert "model.embed_tokens.weight" in msg and "[2048, 512]" in msg and "[2048, 256]" in msg
    assert "shape mismatch" in msg


def test_rows_permutation_is_the_adapters():
    """q/k read in row blocks (as shards are) equal what torchtitan's adapter does to a whole tensor."""
    from torchtitan.models.llama3 import llama3_args

    from torchtpu.models.hf_adapter import HFLayout

    for args in (llama3_args["debugmodel"], llama3_args["8B"]):
        layout = HFLayout(args)
        for tt in ("layers.3.attention.wq.weight", "layers.3.attention.wk.weight"):
            (hf_name,) = layout.sources(tt)
            w = torch.randn(layout.hf_shapes[hf_name])
            ref = layout.adapter.from_hf({hf_name: w})[tt]
            n = w.shape[0] // 4
            got = torch.cat(
                [layout.read(tt, (slice(i, i + n),), lambda h, index, w=w: w[index]) for i in range(0, 4 * n, n)]
            )
            assert torch.equal(got, ref), hf_name
            assert not torch.equal(w, ref)  # a real permutation
    up = layout._rows["layers.0.feed_forward.w3.weight"][2]
    assert (up == range(14336)).all()  # not permuted


_MEMORY_WORKER = textwrap.dedent("""
    import gc, json, os, sys
    port, pid, n, folder, args_json = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    import jax, numpy as np, torch
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from torchtitan.models.llama3 import Transformer
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtpu.train.checkpoint.hf import load_hf_arrays
    args = TransformerModelArgs(**json.loads(args_json))
    with torch.device("meta"):
        m = Transformer(args)
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    targets = {k: (tuple(v.shape), torch.float32, NamedSharding(mesh, P("fsdp") if v.ndim == 2 else P()))
               for k, v in m.state_dict().items()}
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    gc.collect()
    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    arrays = load_hf_arrays(folder, targets, args)
    jax.block_until_ready(list(arrays.values()))
    peak = status("VmHWM:")
    local = sum(s.data.nbytes for a in arrays.values() for s in a.addressable_shards)
    # a value check: the shards of the embedding this process holds are rows of the file's tensor
    from safetensors import safe_open
    idx = json.load(open(os.path.join(folder, "model.safetensors.index.json")))["weight_map"]
    emb = arrays["tok_embeddings.weight"]
    with safe_open(os.path.join(folder, idx["model.embed_tokens.weight"]), "pt") as f:
        sl = f.get_slice("model.embed_tokens.weight")
        for s in emb.addressable_shards:
            assert np.array_equal(np.asarray(s.data), sl[s.index].numpy())
    print("MEMORY", json.dumps({"peak_delta": peak - before, "local_bytes": local}), flush=True)
    jax.distributed.shutdown()
""")


def test_sharded_load_peak_host_memory_is_a_hosts_share(tmp_path):
    """4 processes x 2 devices load a 270 MB model, FSDP over all 8 devices. Each process's peak
    resident memory during the load grows by about its quarter of the model, not the whole model.

    Measured with VmHWM (reset before the load through /proc/self/clear_refs), which sees every
    allocation, NumPy's and XLA's included, and the file pages safetensors maps."""
    import dataclasses

    from torchtitan.models.llama3 import llama3_args

    args = dataclasses.replace(llama3_args["debugmodel"], dim=1024, n_layers=4, n_heads=16, vocab_size=8192)
    folder = _write_folder(tmp_path / "model", args, max_shard_bytes=64 << 20)
    total = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    fields = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(args)
        if f.name not in ("_enforced", "rope_scaling_args")
    }
    port = free_port()
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=cpu_flags(2),
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    n = 4
    outs = run_together(
        [
            [sys.executable, "-c", _MEMORY_WORKER, str(port), str(i), str(n), folder, json.dumps(fields)]
            for i in range(n)
        ],
        env,
    )
    results = []
    for out in outs:
        line = [ln for ln in out.splitlines() if ln.startswith("MEMORY ")][-1]
        results.append(json.loads(line.split(" ", 1)[1]))
    for r in results:
        print(
            f"model {total / 2**20:.0f} MiB; this process holds {r['local_bytes'] / 2**20:.0f} MiB; "
            f"peak resident growth during the load {r['peak_delta'] / 2**20:.0f} MiB "
            f"({r['peak_delta'] / total:.2f} x the model)"
        )
        assert r["local_bytes"] < 0.3 * total
        # its share plus transients, far from the whole model (4 shares, and a process that read it
        # all would grow by 5): alone 1.0-1.3 shares are measured; beside the rest of the suite 1.65
        # and 2.08 (CI): VmHWM counts every resident page, the libraries' file pages included, so
        # what the other processes do moves it
        assert r["peak_delta"] < 3.0 * r["local_bytes"], (r, total)
