"""`torchtpu-convert`: model weights between torchtpu, Hugging Face, torchtitan DCP and torch.save.

    torchtpu-convert SRC DST --to hf       --flavor 8B [--model llama3] [--dtype bfloat16] [--tokenizer PATH]
    torchtpu-convert SRC DST --to hf       --flavor 671B --model deepseek_v3 --seq-len 4096
    torchtpu-convert SRC DST --to torchtpu --flavor 8B [--step 0]
    torchtpu-convert SRC DST --to dcp      --flavor 8B
    torchtpu-convert SRC DST --to torch    --flavor 8B
    python -m torchtpu.convert ...         (the same)

SRC's format is recognised from what it holds (--from names it explicitly):

* torchtpu: a torchtpu-train checkpoint folder (its newest step, or --step) or one step_N folder,
  full or model-only; only the model weights are read;
* hf: a Hugging Face folder (config.json + model.safetensors or an index and its shards);
* dcp: a torch.distributed.checkpoint folder (.metadata), as torchtitan writes: model keys at the
  top level (or under "model."); optimizer and other state are skipped;
* torch: a file written by torch.save holding a state dict (or {"model": state dict}).

--model names the family (torchtpu.models.registry); without it, the family whose --flavor
model the source's tensors fit. Inside, every format is the torchtitan model's state dict; Hugging
Face names and layouts (Llama 3's q/k permutation, one tensor per expert) come from the family's
torchtitan state-dict adapter (torchtpu.models.hf_adapter). A tensor the Hugging Face layout has
no place for (Qwen3 MoE's expert_bias) is zero when read from it, and must be zero to be written
to it; a tied output projection is written once to Hugging Face and under both names elsewhere. Sources are read one tensor at a time
(safetensors slices, DCP per-key loads, torch.load with mmap, Orbax partial restores). A Hugging
Face output is written tensor by tensor in files of at most --max-shard-size, with a tokenizer
(--tokenizer, as the trainer's [model] hf_assets_path; by default a Hugging Face source's own, else
torchtpu's bundled one) and its BOS/EOS/pad ids, so transformers and vLLM load the folder as it
is. DeepSeek-V3's config.json depends on the length the model was trained at (YaRN only above its
original_seq_len): --seq-len names it, a Hugging Face source's max_position_embeddings stands for it,
and a Hugging Face output from other weights without it is refused. DCP, torch.save and torchtpu
outputs are written from one in-memory copy. Runs on the CPU; no
TPU is needed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

__all__ = ["main", "open_source", "write_output", "FORMATS"]

FORMATS = ("torchtpu", "hf", "dcp", "torch")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NOT_MODEL = ("optimizer", "lr_scheduler", "dataloader", "train_state")


class ConvertError(ValueError):
    """Bad input to the converter; the message names it and the fix."""


def detect_format(path: str) -> str:
    from torchtpu.train.checkpoint.hf import is_hf_folder

    if os.path.isfile(path):
        return "torch"
    if not os.path.isdir(path):
        raise ConvertError(f"{path} does not exist")
    if is_hf_folder(path):
        return "hf"
    if os.path.isfile(os.path.join(path, ".metadata")):
        return "dcp"
    if os.path.isdir(os.path.join(path, "manifest")) or any(
        e.startswith("step_") and os.path.isdir(os.path.join(path, e, "manifest")) for e in os.listdir(path)
    ):
        return "torchtpu"
    raise ConvertError(
        f"{path}: not a torchtpu checkpoint, Hugging Face folder, DCP folder or torch.save file; "
        "name its format with --from"
    )


# ----------------------------------------------------------------------------------- sources
# A source: .entries -> [(torchtitan name, shape)] in the model's order; .get(name) -> full CPU tensor.


class _HFSource:
    def __init__(self, path, model_args):
        from torchtpu.models.hf_adapter import HFLayout
        from torchtpu.train.checkpoint.hf import HFFolder

        self.hf = HFFolder(path)
        self.layout = HFLayout(model_args)
        self.layout.check_readable()
        have = set(self.hf.names())
        self.entries = []
        for name, shape in self.layout.shapes.items():
            src = self.layout.aliases.get(name, name)
            hfs = self.layout.sources(src)
            if src in self.layout.dropped or (hfs and all(h in have for h in hfs)):
                self.entries.append((name, self._shape(src, hfs, shape)))
        self._group: dict = {}

    def _shape(self, name, hfs, shape):
        # the folder's own shapes, so that a wrong flavor is reported as a shape mismatch
        if self.layout.sliced(name) and len(hfs) == 1 and len(self.layout.hf_shapes[hfs[0]]) == len(shape):
            return self.hf.info(hfs[0])[0]
        return tuple(shape)

    def get(self, name):
        layout = self.layout
        name = layout.aliases.get(name, name)
        if name in layout.dropped:
            return torch.zeros(layout.shapes[name])  # the Hugging Face model computes without it
        if layout.sliced(name):
            value = layout.read(name, (), self.hf.read)
        else:
            if name not in self._group:
                self._group = layout.from_hf_group({h: self.hf.read(h) for h in layout.sources(name)})
            value = self._group[name]
        self.hf.release()
        return value


class _DCPSource:
    def __init__(self, path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        meta = FileSystemReader(path).read_metadata().state_dict_metadata
        self.key_of, self.meta = {}, {}
        for key, m in meta.items():
            if not isinstance(m, TensorStorageMetadata) or key.split(".", 1)[0] in _NOT_MODEL:
                continue
            name = key.removeprefix("model.")
            self.key_of[name] = key
            self.meta[name] = m
        self.entries = [(n, tuple(m.size)) for n, m in self.meta.items()]

    def get(self, name):
        import torch.distributed.checkpoint as dcp

        m = self.meta[name]
        sd = {self.key_of[name]: torch.empty(tuple(m.size), dtype=m.properties.dtype)}
        dcp.load(sd, checkpoint_id=self.path)  # only this key is read
        return sd[self.key_of[name]]


class _TorchSource:
    def __init__(self, path):
        from torchtpu.train.checkpoint.manager import canonical_name

        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)  # mapped, not read
        if isinstance(sd, dict) and isinstance(sd.get("model"), dict):
            sd = sd["model"]
        if not isinstance(sd, dict):
            raise ConvertError(f"{path} holds a {type(sd).__name__}, not a state dict")
        self.sd = {canonical_name(k).removeprefix("module."): v for k, v in sd.items() if isinstance(v, torch.Tensor)}
        self.entries = [(k, tuple(v.shape)) for k, v in self.sd.items()]

    def get(self, name):
        return self.sd[name]


class _TorchtpuSource:
    def __init__(self, path, step):
        from torchtpu.train.checkpoint.manager import CheckpointManager, canonical_name, split_step_path

        folder, in_path = split_step_path(path)
        self.ck = CheckpointManager(folder, interval=1, async_mode="sync", read_only=True)
        self.step = step if step is not None else in_path if in_path is not None else self.ck.latest_step()
        if self.step is None:
            raise ConvertError(f"{path}: no checkpoint (step_N folder) in it")
        tree = self.ck.manifest(self.step)  # {"dict": [[key, node], ...]} (torchtpu.train.checkpoint.manager's format)
        model = dict(tree["dict"]).get("model") if "dict" in tree else None
        if not model or "dict" not in model:
            raise ConvertError(f"{self.ck.step_path(self.step)} holds no model weights")
        self.key_of = {canonical_name(k): k for k, node in model["dict"] if "array" in node}
        shapes = {canonical_name(k): tuple(node["shape"]) for k, node in model["dict"] if "array" in node}
        self.entries = [(n, shapes[n]) for n in self.key_of]

    def get(self, name):
        t = self.ck.restore(self.step, subtree=("model", self.key_of[name]))  # reads this array only
        return t.detach().cpu() if isinstance(t, torch.Tensor) else torch.from_numpy(__import__("numpy").asarray(t))


def open_source(path: str, fmt: str | None, model_args, step: int | None = None):
    fmt = fmt or detect_format(path)
    if fmt == "hf":
        return _HFSource(path, model_args)
    if fmt == "dcp":
        return _DCPSource(path)
    if fmt == "torch":
        return _TorchSource(path)
    return _TorchtpuSource(path, step)


# ----------------------------------------------------------------------------------- outputs


def _check_names(src, model_args):
    """Every source tensor must be one of the model's, with the model's shape."""
    from torchtpu.models.hf_adapter import family_for_args

    family = family_for_args(model_args).name
    with torch.device("meta"):
        model = family_for_args(model_args).torchtitan_model(model_args)
        want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    have = dict(src.entries)
    for k, shape in want.items():
        if k in have and have[k] != shape:
            raise ConvertError(
                f"the source's {k} is {list(have[k])} but the {family} flavor's is {list(shape)}; pass the "
                "--flavor (and --model) it was trained with"
            )
    missing = [k for k in want if k not in have]
    extra = [k for k in have if k not in want]
    if missing or extra:
        raise ConvertError(
            f"the source does not hold this {family} flavor's weights (missing {missing[:3]}, unexpected "
            f"{extra[:3]}); pass the --flavor (and --model) it was trained with"
        )
    return list(want)  # the model's own order


def write_output(
    src,
    dst: str,
    fmt: str,
    model_args,
    dtype: torch.dtype,
    step: int = 0,
    max_shard_bytes: int | None = None,
    tokenizer=None,
) -> str:
    order = _check_names(src, model_args)

    def cast(t):
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    if fmt == "hf":
        from torchtpu.train.checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, save_hf

        shapes = dict(src.entries)
        return save_hf(
            dst,
            [(n, shapes[n]) for n in order],
            src.get,
            model_args,
            dtype,
            max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
            tokenizer=tokenizer,
        )
    state = {n: cast(src.get(n)).contiguous() for n in order}
    if fmt == "torch":
        torch.save(state, dst)
    elif fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        # No process group: this process is the one writer. thread_count=2 picks DCP's plain CPU
        # loader: its single-thread path asks the registered accelerator module (torch.tpu once
        # torchtpu is imported) for CUDA-style streams, which the tpu device does not have.
        dcp.save(state, storage_writer=dcp.FileSystemWriter(dst, thread_count=2))
    else:
        import jax

        from torchtpu.backend import dtypes
        from torchtpu.train.checkpoint.manager import CheckpointManager

        dev = jax.local_devices()[0]
        arrays = {}
        for n in list(state):
            arrays[n] = jax.device_put(dtypes.torch_to_numpy(state.pop(n)), dev)
        ck = CheckpointManager(dst, interval=1, keep_latest_k=0, async_mode="sync")
        try:
            ck.save(step, {"model": arrays, "model_only": True, "step": int(step)}, force=True)
        finally:
            ck.close()
        dst = ck.step_path(step)
    return dst


def _model_args(model: str | None, flavor: str):
    """The flavor's arguments of family `model`; with no model, of every family that has the flavor."""
    from torchtpu.models.registry import FAMILIES, UnknownModel, get_family

    try:
        families = [get_family(model)] if model else [f for f in FAMILIES.values() if flavor in f.flavors]
        if not families:
            known = "; ".join(f"{n}: {', '.join(f.flavors)}" for n, f in FAMILIES.items())
            raise ConvertError(f"--flavor {flavor!r} is no family's flavor; flavors: {known}")
        return [f.model_args(flavor) for f in families]
    except UnknownModel as e:
        raise ConvertError(f"--model/--flavor: {e}") from None


def _set_seq_len(candidates, seq_len, src, src_format):
    """Set max_seq_len of the candidates' arguments to --seq-len, else to a Hugging Face source's
    max_position_embeddings; returns the length set (None: the flavors' own)."""
    import json

    if seq_len is None and src_format == "hf":
        with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
            seq_len = json.load(f).get("max_position_embeddings")
    for args in candidates:
        if seq_len is not None:
            args.max_seq_len = int(seq_len)
    return seq_len


def _check_seq_len_known(model_args):
    """A family whose config.json depends on the training length (its `torchtpu.models.<name>.hf`
    has `seq_len_dependent(args)`) is not written to Hugging Face without it."""
    import importlib

    from torchtpu.models.hf_adapter import family_for_args

    family = family_for_args(model_args).name
    try:
        dependent = importlib.import_module(f"torchtpu.models.{family}.hf").seq_len_dependent
    except (ModuleNotFoundError, AttributeError):
        return
    why = dependent(model_args)
    if why:
        raise ConvertError(f"--seq-len: {why}; pass the training.seq_len these {family} weights were trained at")


def _open_fitting(path, fmt, candidates, step):
    """(source, model arguments) of the first candidate whose model the source's tensors fit; the
    first candidate's error when none does."""
    first = None
    for args in candidates:
        try:
            src = open_source(path, fmt, args, step)
            _check_names(src, args)
            return src, args
        except (ConvertError, ValueError, KeyError) as e:
            first = first or e
    raise first


def output_tokenizer(choice: str | None, src: str, src_format: str, model_args):
    """The tokenizer a Hugging Face output gets: --tokenizer's (None for 'none'); by default a
    Hugging Face source's own tokenizer files, else torchtpu's bundled tokenizer."""
    from torchtpu.train.tokenizer import build_tokenizer

    if choice is not None and choice.lower() == "none":
        return None
    if choice is None and src_format == "hf":
        if any(os.path.isfile(os.path.join(src, n)) for n in ("tokenizer.json", "tokenizer.model")):
            choice = src
    try:
        tok = build_tokenizer(choice or None)
    except (OSError, ValueError) as e:
        raise ConvertError(f"--tokenizer: {e}") from None
    if tok.vocab_size > model_args.vocab_size:
        raise ConvertError(
            f"--tokenizer {tok.source}: {tok.vocab_size} ids but the model's vocabulary has "
            f"{model_args.vocab_size}; pass the tokenizer the model was trained with (or --tokenizer none)"
        )
    return tok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="torchtpu-convert", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="checkpoint to read (format recognised, or --from)")
    p.add_argument("dst", help="where to write (a folder, or a file for --to torch)")
    p.add_argument("--to", required=True, choices=FORMATS, help="output format")
    p.add_argument("--from", dest="src_format", choices=FORMATS, help="input format (default: recognised)")
    p.add_argument(
        "--flavor", required=True, help="torchtitan flavor of the weights (debugmodel, 8B, 0.6B, 30B-A3B, ...)"
    )
    p.add_argument(
        "--model",
        default=None,
        help="model family (llama3, qwen3, ...; default: the family whose --flavor the source's tensors fit)",
    )
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="dtype of the floating weights written")
    p.add_argument(
        "--step",
        type=int,
        default=None,
        help="torchtpu input: the step to read (default: newest); torchtpu output: the step_N to write (default 0)",
    )
    p.add_argument(
        "--max-shard-size",
        type=int,
        default=None,
        metavar="BYTES",
        help="Hugging Face output: largest safetensors file (default 5 GiB)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="N",
        help="the training.seq_len the weights were trained at, for a family whose Hugging Face config.json "
        "depends on it (DeepSeek-V3: YaRN above original_seq_len); default: a Hugging Face source's "
        "max_position_embeddings",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="Hugging Face output: the tokenizer written beside the weights, a folder or file as [model] "
        "hf_assets_path takes (default: a Hugging Face source's own, else torchtpu's bundled one; "
        "'none' writes none)",
    )
    a = p.parse_args(argv)
    try:
        src_format = a.src_format or detect_format(a.src)
        candidates = _model_args(a.model, a.flavor)
        seq_len = _set_seq_len(candidates, a.seq_len, a.src, src_format)
        src, args = _open_fitting(a.src, src_format, candidates, a.step if src_format == "torchtpu" else None)
        if a.to == "hf" and seq_len is None:
            _check_seq_len_known(args)
        tok = output_tokenizer(a.tokenizer, a.src, src_format, args) if a.to == "hf" else None
        out = write_output(
            src, a.dst, a.to, args, _DTYPES[a.dtype], step=a.step or 0, max_shard_bytes=a.max_shard_size, tokenizer=tok
        )
    except (ConvertError, ValueError, KeyError) as e:
        print(f"torchtpu-convert: {e}", file=sys.stderr)
        return 2
    print(f"torchtpu-convert: wrote {a.to} {out}" + (f" (tokenizer {tok.source})" if tok is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
