"""Hugging Face safetensors folders in and out: sharded reads, streamed writes.

A Hugging Face model folder is `config.json` plus either `model.safetensors` or
`model.safetensors.index.json` and the `*.safetensors` files it names. Names and the RoPE row
permutation of q/k come from torchtitan's state-dict adapter (torchtpu.models.llama3.hf). An
exported folder also holds the tokenizer's files, with its BOS/EOS/pad ids in `config.json` and
`generation_config.json`, so transformers, vLLM and torchtpu.generate load it with no other path.

    load_hf_into_model(folder, model, model_args)   # fill a (sharded) tpu model in place
    save_model_as_hf(folder, model, model_args, torch.bfloat16, tokenizer=build_tokenizer(None))
    arrays = load_hf_arrays(folder, {name: (shape, dtype, sharding)}, model_args)

Reading is sharded: each process asks safetensors for exactly the slices of each tensor that its
own devices hold (`get_slice`, which reads those bytes of the file and no others; a q/k shard
reads the whole heads it overlaps), so no process ever holds more than its share of the model
plus one device shard. Writing gathers one tensor at a time and keeps at most one output file's
tensors (`max_shard_bytes`) in host memory; only process 0 writes.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch

from torchtpu.models.llama3.hf import HFNames, check_hf_config, hf_config

__all__ = [
    "HFCheckpointError",
    "HFFolder",
    "is_hf_folder",
    "load_hf_arrays",
    "load_hf_into_model",
    "save_hf",
    "save_model_as_hf",
    "DEFAULT_MAX_SHARD_BYTES",
]

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # Hugging Face's own default shard size


class HFCheckpointError(ValueError):
    """A Hugging Face folder cannot be read or does not fit the model; the message names the tensor."""


def is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG)) and (
        os.path.isfile(os.path.join(path, SINGLE)) or os.path.isfile(os.path.join(path, INDEX))
    )


class HFFolder:
    """The tensors of a Hugging Face folder: names, shapes, dtypes, and slices of them on demand."""

    def __init__(self, folder: str):
        self.folder = os.path.abspath(os.path.expanduser(str(folder)))
        if not os.path.isdir(self.folder):
            raise HFCheckpointError(
                f"{self.folder} is not a folder; point to a Hugging Face model folder ({CONFIG} + {SINGLE} or {INDEX})"
            )
        cfg_path = os.path.join(self.folder, CONFIG)
        if not os.path.isfile(cfg_path):
            raise HFCheckpointError(f"{self.folder} has no {CONFIG}; point to a Hugging Face model folder")
        with open(cfg_path, encoding="utf-8") as f:
            self.config = json.load(f)
        index = os.path.join(self.folder, INDEX)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map") or {}
            self.files = {name: os.path.join(self.folder, file) for name, file in weight_map.items()}
        elif os.path.isfile(os.path.join(self.folder, SINGLE)):
            self.files = None  # filled from the one file's header below
        else:
            raise HFCheckpointError(f"{self.folder} has neither {SINGLE} nor {INDEX}; it holds no safetensors weights")
        self._handles: dict[str, object] = {}
        if self.files is None:
            path = os.path.join(self.folder, SINGLE)
            self.files = {name: path for name in self._open(path).keys()}

    def _open(self, path: str):
        h = self._handles.get(path)
        if h is None:
            from safetensors import safe_open

            if not os.path.isfile(path):
                raise HFCheckpointError(f"{path} is named in {INDEX} but missing; the download is incomplete")
            try:
                h = safe_open(path, framework="pt")
            except Exception as e:  # noqa: BLE001
                raise HFCheckpointError(f"{path} is not a readable safetensors file ({e}); re-download it") from e
            self._handles[path] = h
        return h

    def names(self) -> list[str]:
        return list(self.files)

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype string) from the file header, without reading data."""
        sl = self._open(self.files[name]).get_slice(name)
        return tuple(sl.get_shape()), sl.get_dtype()

    def read(self, name: str, index: tuple = ()) -> torch.Tensor:
        """tensor[index] (a tuple of slices), reading only those bytes."""
        sl = self._open(self.files[name]).get_slice(name)
        return sl[index] if index else sl[:]

    def release(self) -> None:
        """Close the files: safetensors maps them, and the pages a read touched stay resident (and
        count against this process) until the mapping goes."""
        self._handles.clear()

    close = release


def _bounds(index: tuple, shape: tuple) -> list[tuple[int, int]]:
    out = []
    for i, n in enumerate(shape):
        s = index[i] if i < len(index) else slice(None)
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        out.append((start, stop))
    return out


def _match(hf: HFFolder, names: HFNames, targets: dict) -> dict[str, str]:
    """torchtitan name -> Hugging Face name for every target, checking names and shapes."""
    where = hf.folder
    to_hf = {}
    extra = []
    for hf_name in hf.names():
        try:
            tt = names.from_hf(hf_name)
        except KeyError:
            extra.append(hf_name)
            continue
        if tt is None:
            continue  # a tensor the model recomputes (rotary inv_freq)
        if tt not in targets:
            extra.append(hf_name)
            continue
        to_hf[tt] = hf_name
    missing = [n for n in targets if n not in to_hf]
    if missing:
        ex = [names.to_hf(n) for n in missing[:3]]
        raise HFCheckpointError(
            f"{where} lacks {len(missing)} tensor(s) the model needs: {', '.join(ex)}"
            f"{' ...' if len(missing) > 3 else ''} (config.json says num_hidden_layers = "
            f"{hf.config.get('num_hidden_layers')}); use the [model] flavor these weights were made for"
        )
    if extra:
        raise HFCheckpointError(
            f"{where} holds {len(extra)} tensor(s) this model has no place for: {', '.join(extra[:3])}"
            f"{' ...' if len(extra) > 3 else ''} (config.json says num_hidden_layers = "
            f"{hf.config.get('num_hidden_layers')}); use the [model] flavor these weights were made for"
        )
    for tt in targets:  # in the model's order: the embedding first
        hf_name = to_hf[tt]
        shape, _ = hf.info(hf_name)
        want = tuple(targets[tt][0])
        if shape != want:
            vocab = hf_name in ("model.embed_tokens.weight", "lm_head.weight") and shape[0] != want[0]
            what = "vocabulary size" if vocab else "shape"
            raise HFCheckpointError(
                f"{hf_name} in {where} is {list(shape)} but the model's {tt} is {list(want)} ({what} mismatch); "
                "use the [model] flavor these weights were made for"
            )
    return to_hf


def load_hf_arrays(folder: str, targets: dict, model_args) -> dict:
    """Read a Hugging Face folder into sharded `jax.Array`s.

    targets: torchtitan name -> (shape, torch dtype, jax Sharding). Each process reads only the
    slices its own devices hold (jax.make_array_from_callback calls back per addressable device)."""
    import jax

    from torchtpu.backend import dtypes

    hf = HFFolder(folder)
    try:
        try:
            check_hf_config(hf.config, model_args)
        except ValueError as e:
            raise HFCheckpointError(f"{hf.folder}/{e}; use the [model] flavor these weights were made for") from None
        names = HFNames(model_args)
        to_hf = _match(hf, names, targets)
        out = {}
        for tt, (shape, dtype, sharding) in targets.items():
            hf_name = to_hf[tt]
            shape = tuple(shape)
            perm = names.rows_from_hf(hf_name, shape[0]) if len(shape) == 2 else None
            done: dict = {}

            def piece(index, hf_name=hf_name, shape=shape, perm=perm, dtype=dtype, done=done):
                b = _bounds(index, shape)
                key = tuple(b)
                if key in done:  # a replica of a shard already read for another local device
                    return done[key]
                if perm is None:
                    t = hf.read(hf_name, tuple(slice(lo, hi) for lo, hi in b))
                else:
                    # the shard's rows come from the (whole-head) HF rows perm[lo:hi]
                    rows = perm[b[0][0] : b[0][1]]
                    lo, hi = int(rows.min()), int(rows.max()) + 1
                    block = hf.read(hf_name, (slice(lo, hi),) + tuple(slice(a, z) for a, z in b[1:]))
                    t = block[torch.from_numpy(rows - lo)]
                a = dtypes.torch_to_numpy(t.to(dtype).contiguous())
                done[key] = a
                return a

            out[tt] = jax.make_array_from_callback(shape, sharding, piece)
            done.clear()
            hf.release()  # one tensor's pages mapped at a time
        return out
    finally:
        hf.close()


def load_hf_into_model(folder: str, model: torch.nn.Module, model_args) -> None:
    """Fill a torchtitan Llama 3 model's parameters (tpu tensors, any sharding) in place from a
    Hugging Face folder; each parameter keeps its own sharding and dtype."""
    from torchtpu.backend.tensor import TpuTensor
    from torchtpu.backend.views import array_of, write

    from .checkpoint import canonical_name

    own = {canonical_name(k): t for k, t in model.state_dict(keep_vars=True).items()}
    for k, t in own.items():
        if not isinstance(t, TpuTensor):
            raise TypeError(f"load_hf_into_model: {k} is on {t.device}; move the model to 'tpu' first")
    targets = {k: (tuple(t.shape), t.dtype, array_of(t).sharding) for k, t in own.items()}
    arrays = load_hf_arrays(folder, targets, model_args)
    with torch.no_grad():
        for k, a in arrays.items():
            write(own[k], a)


def _plan_files(entries: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    files: list[list[str]] = [[]]
    size = 0
    for name, nbytes in entries:
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def save_hf(
    folder: str,
    entries: list[tuple[str, tuple]],
    fetch,
    model_args,
    dtype: torch.dtype,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    write: bool = True,
    tokenizer=None,
) -> str:
    """Write torchtitan-named tensors as a Hugging Face folder, one tensor fetched at a time.

    entries: [(torchtitan name, shape)] in the order to write; fetch(name) -> the full tensor (CPU)
    (called on every process: it may be a collective gather); floating tensors are cast to
    `dtype`. Only a process with `write` set writes. Written into a temporary folder that
    replaces `folder` when complete. With `tokenizer` (torchtpu.train.tokenizer), its files and
    special-token ids go in too."""
    from safetensors.torch import save_file

    names = HFNames(model_args)
    itemsize = torch.empty((), dtype=dtype).element_size()
    hf_names = {n: names.to_hf(n) for n, _ in entries}
    files = _plan_files([(n, int(np.prod(shape)) * itemsize) for n, shape in entries], max_shard_bytes)
    folder = os.path.abspath(os.path.expanduser(str(folder)))
    tmp = folder + ".tmp"
    if write:
        if os.path.exists(folder) and not (is_hf_folder(folder) or not os.listdir(folder)):
            raise HFCheckpointError(
                f"{folder} exists and is not a Hugging Face model folder; it will not be "
                "overwritten: choose another output folder"
            )
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    single = len(files) == 1
    weight_map = {}
    total = 0
    for i, group in enumerate(files):
        fname = SINGLE if single else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        tensors = {}
        for n in group:
            t = fetch(n)
            if t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            hf_name, v = names.tensor_to_hf(n, t)
            assert hf_name == hf_names[n]
            tensors[hf_name] = v.contiguous()
            weight_map[hf_name] = fname
            total += v.numel() * v.element_size()
        if write:
            save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
        del tensors
    if write:
        cfg = hf_config(model_args, str(dtype).removeprefix("torch."))
        if tokenizer is not None:
            ids = special_token_ids(tokenizer)
            cfg.update(ids)
            with open(os.path.join(tmp, GENERATION_CONFIG), "w", encoding="utf-8") as f:
                json.dump(ids, f, indent=2)
            tokenizer.export_files(tmp)
        with open(os.path.join(tmp, CONFIG), "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
        if not single:
            with open(os.path.join(tmp, INDEX), "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        if os.path.exists(folder):
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    return folder


def special_token_ids(tokenizer) -> dict:
    """The BOS/EOS/pad ids as config.json and generation_config.json name them."""
    return {
        "bos_token_id": int(tokenizer.bos_id),
        "eos_token_id": int(tokenizer.eos_id),
        "pad_token_id": int(tokenizer.pad_id),
    }


def gather_to_cpu(t: torch.Tensor) -> torch.Tensor:
    """The full value of a (possibly sharded, possibly multi-host) tpu tensor as a CPU tensor.
    With several processes this is a collective: every process must call it."""
    import jax

    from torchtpu.backend import dtypes
    from torchtpu.backend.tensor import TpuTensor
    from torchtpu.backend.views import array_of

    if not isinstance(t, TpuTensor):
        return t.detach().cpu()
    a = array_of(t)
    if jax.process_count() > 1 and not a.is_fully_addressable:
        from jax.experimental import multihost_utils

        host = np.asarray(multihost_utils.process_allgather(a, tiled=True))
    else:
        host = np.asarray(a)
    return dtypes.numpy_to_torch(host, t.dtype)


def save_model_as_hf(
    folder: str,
    model: torch.nn.Module,
    model_args,
    dtype: torch.dtype,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer=None,
) -> str:
    """Write a torchtitan Llama 3 model (tpu tensors, any sharding) as a Hugging Face folder, with
    `tokenizer`'s files when given. Every process calls it (the gathers are collective); process 0
    writes."""
    import jax

    from .checkpoint import canonical_name

    own = {canonical_name(k): t for k, t in model.state_dict(keep_vars=True).items()}
    entries = [(k, tuple(t.shape)) for k, t in own.items()]
    return save_hf(
        folder,
        entries,
        lambda n: gather_to_cpu(own[n].detach()),
        model_args,
        dtype,
        max_shard_bytes,
        write=jax.process_index() == 0,
        tokenizer=tokenizer,
    )
