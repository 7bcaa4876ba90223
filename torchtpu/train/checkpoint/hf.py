"""Hugging Face safetensors folders in and out: sharded reads, streamed writes.

A Hugging Face model folder is `config.json` plus either `model.safetensors` or
`model.safetensors.index.json` and the `*.safetensors` files it names. Names and layouts (Llama 3's
q/k row permutation, Mixture-of-Experts weights one tensor per expert, a tied output projection
left out) come from the model family's torchtitan state-dict adapter, through
torchtpu.models.hf_adapter; config.json from the family's torchtpu.models.<family>.hf. An
exported folder also holds the tokenizer's files, with its BOS/EOS/pad ids in `config.json` and
`generation_config.json`, so transformers, vLLM and torchtpu.generate load it with no other path.

    load_hf_into_model(folder, model, model_args)   # fill a (sharded) tpu model in place
    save_model_as_hf(folder, model, model_args, torch.bfloat16, tokenizer=build_tokenizer(None))
    arrays = load_hf_arrays(folder, {name: (shape, dtype, sharding)}, model_args)

Reading is sharded: each process asks safetensors for exactly the slices of each tensor that its
own devices hold (`get_slice`, which reads those bytes of the file and no others; a q/k shard
reads the whole heads it overlaps, an expert shard the experts it holds), so no process ever holds more than its share of the model
plus one device shard. Writing gathers one tensor at a time and keeps at most one output file's
tensors (`max_shard_bytes`) in host memory; only process 0 writes.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch

from torchtpu.models.hf_adapter import HFLayout, HFLayoutError

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


def _layout(model_args) -> HFLayout:
    try:
        return HFLayout(model_args)
    except HFLayoutError as e:
        raise HFCheckpointError(str(e)) from None


def _match(hf: HFFolder, layout: HFLayout, targets) -> None:
    """Every Hugging Face tensor the targets need is in the folder with the model's shape, and the
    folder holds nothing the model has no place for."""
    where = hf.folder
    need = [h for t in targets for h in layout.sources(t)]
    have = set(hf.names())
    layers = hf.config.get("num_hidden_layers")
    missing = [h for h in need if h not in have]
    if missing:
        raise HFCheckpointError(
            f"{where} lacks {len(missing)} tensor(s) the model needs: {', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''} (config.json says num_hidden_layers = "
            f"{layers}); use the [model] flavor these weights were made for"
        )
    skip = tuple(getattr(layout._config_module(), "ignored_hf_tensors", lambda config: ())(hf.config))
    extra = [
        h
        for h in hf.names()
        if h not in layout.hf_shapes and not (skip and h.startswith(skip)) and layout.unknown(h, hf.info(h)[0])
    ]
    if extra:
        raise HFCheckpointError(
            f"{where} holds {len(extra)} tensor(s) this model has no place for: {', '.join(extra[:3])}"
            f"{' ...' if len(extra) > 3 else ''} (config.json says num_hidden_layers = "
            f"{layers}); use the [model] flavor these weights were made for"
        )
    vocab = getattr(layout.model_args, "vocab_size", None)
    for h in need:  # in the model's order: the embedding first
        shape, want = hf.info(h)[0], layout.hf_shapes[h]
        if shape != want:
            what = "vocabulary size" if vocab in (shape[0], want[0]) and shape[0] != want[0] else "shape"
            raise HFCheckpointError(
                f"{h} in {where} is {list(shape)} but the model's {', '.join(layout.hf_to_tt[h])} needs "
                f"{list(want)} ({what} mismatch); use the [model] flavor these weights were made for"
            )


def load_hf_arrays(folder: str, targets: dict, model_args) -> dict:
    """Read a Hugging Face folder into sharded `jax.Array`s.

    targets: torchtitan name -> (shape, torch dtype, jax Sharding). Each process reads only the
    slices its own devices hold (jax.make_array_from_callback calls back per addressable device)."""
    import jax

    from torchtpu.backend import dtypes

    layout = _layout(model_args)
    hf = HFFolder(folder)
    try:
        try:
            layout.check_hf_config(hf.config)
        except ValueError as e:
            raise HFCheckpointError(f"{hf.folder}/{e}; use the [model] flavor these weights were made for") from None
        layout.check_readable()
        names = {t: layout.aliases.get(t, t) for t in targets if layout.aliases.get(t, t) not in layout.dropped}
        _match(hf, layout, dict.fromkeys(names.values()))
        out = {}
        for tt, (shape, dtype, sharding) in targets.items():
            if tt not in names:
                continue  # no Hugging Face tensor (a buffer the Hugging Face model does without): kept as is
            src = names[tt]
            shape = tuple(shape)
            if tuple(layout.shapes[src]) != shape:
                raise HFCheckpointError(
                    f"the model's {tt} is {list(shape)} but its arguments make {list(layout.shapes[src])}"
                )
            whole = None
            if not layout.sliced(src):  # made from tensors the adapter fuses: converted whole, then sliced
                unit = layout.sources(src)
                whole = layout.from_hf_group({h: hf.read(h) for h in unit})[src]
            done: dict = {}

            def piece(index, src=src, shape=shape, dtype=dtype, done=done, whole=whole):
                b = _bounds(index, shape)
                key = tuple(b)
                if key in done:  # a replica of a shard already read for another local device
                    return done[key]
                index = tuple(slice(lo, hi) for lo, hi in b)
                t = whole[index] if whole is not None else layout.read(src, index, hf.read)
                a = dtypes.torch_to_numpy(t.to(dtype).contiguous())
                done[key] = a
                return a

            out[tt] = jax.make_array_from_callback(shape, sharding, piece)
            done.clear()
            del whole
            hf.release()  # one tensor's pages mapped at a time
        return out
    except HFLayoutError as e:
        raise HFCheckpointError(str(e)) from None
    finally:
        hf.close()


def load_hf_into_model(folder: str, model: torch.nn.Module, model_args) -> None:
    """Fill a torchtitan model's parameters (tpu tensors, any sharding) in place from a Hugging Face
    folder, through its family's adapter; each parameter keeps its own sharding and dtype. A tied
    tensor is written once; a tensor the Hugging Face layout has no place for (Qwen3 MoE's
    expert_bias) keeps its value."""
    from torchtpu.backend import TpuTensor, array_of, write

    from .manager import canonical_name

    own, seen = {}, set()
    for k, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:  # a tied tensor once
            seen.add(id(t))
            own[canonical_name(k)] = t
    for k, t in own.items():
        if not isinstance(t, TpuTensor):
            raise TypeError(f"load_hf_into_model: {k} is on {t.device}; move the model to 'tpu' first")
    import jax

    arrays = {k: array_of(t) for k, t in own.items()}
    mesh = next((a.sharding.mesh for a in arrays.values() if isinstance(a.sharding, jax.sharding.NamedSharding)), None)

    def sharding(a):
        if mesh is not None and not getattr(a, "_committed", True):
            # a buffer init_weights made with no layout (DeepSeek-V3's expert_bias) is uncommitted on one
            # device; read there it would be committed to it and refused beside the mesh's arrays, so
            # it is read replicated over the mesh (as a checkpoint restore does)
            return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return a.sharding

    targets = {k: (tuple(t.shape), t.dtype, sharding(arrays[k])) for k, t in own.items()}
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
    """Write torchtitan-named tensors as a Hugging Face folder, one tensor (or one group the
    family's adapter fuses) fetched at a time, in the layout and names of that adapter.

    entries: [(torchtitan name, shape)], the model's tensors; fetch(name) -> the full tensor (CPU)
    (called on every process: it may be a collective gather); floating tensors are cast to
    `dtype` (but those transformers keeps in float32, the family module's FLOAT32_TENSORS). A tied tensor is written once (as the adapter does); a tensor the Hugging Face layout
    has no place for must be zero (else HFCheckpointError: the export would compute differently).
    Only a process with `write` set writes. Written into a temporary folder that replaces `folder`
    when complete. With `tokenizer` (torchtpu.train.tokenizer), its files and special-token ids
    go in too."""
    from safetensors.torch import save_file

    layout = _layout(model_args)
    try:
        cfg = layout.hf_config(str(dtype).removeprefix("torch."))
    except (ValueError, HFLayoutError) as e:
        raise HFCheckpointError(str(e)) from None
    given = dict((n, tuple(s)) for n, s in entries)
    for n, shape in layout.shapes.items():
        if n not in layout.aliases and given.get(n) != tuple(shape):
            what = "missing" if n not in given else f"{list(given[n])}"
            raise HFCheckpointError(f"the weights' {n} is {what} but the model's is {list(shape)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    files = _plan_files([(h, int(np.prod(shape)) * itemsize) for h, shape in layout.hf_shapes.items()], max_shard_bytes)
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
    fname = [SINGLE] if single else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    file_of = {h: fname[i] for i, group in enumerate(files) for h in group}
    weight_map = {}
    total = 0
    pending: dict = {}
    nxt = 0

    def cast(t):
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    for n in layout.dropped:  # kept out of the export: must not change what the model computes
        t = fetch(n)
        if bool(t.detach().ne(0).any()):
            raise HFCheckpointError(
                f"{n} is nonzero and {type(layout.adapter).__name__} has no Hugging Face tensor for it: "
                "the exported model would compute differently"
            )
        del t
    # tensors transformers keeps in float32 whatever the dtype (DeepSeek-V3's e_score_correction_bias)
    keep = tuple(getattr(layout._config_module(), "FLOAT32_TENSORS", ()))
    for tts, hfs in layout.units:
        try:
            out = layout.to_hf({n: fetch(n) for n in tts})
        except HFLayoutError as e:
            raise HFCheckpointError(str(e)) from None
        out = {h: v if h.endswith(keep) and keep else cast(v) for h, v in out.items()}
        if list(out) != list(hfs):
            raise HFCheckpointError(
                f"{type(layout.adapter).__name__} wrote {list(out)[:3]} for {tts[0]}, not {list(hfs)[:3]}"
            )
        for h, v in out.items():
            pending[h] = v.contiguous()
            weight_map[h] = file_of[h]
            total += v.numel() * v.element_size()
        del out
        while nxt < len(files) and all(h in pending for h in files[nxt]):
            tensors = {h: pending.pop(h) for h in files[nxt]}
            if write:
                save_file(tensors, os.path.join(tmp, fname[nxt]), metadata={"format": "pt"})
            del tensors
            nxt += 1
    if write:
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

    from torchtpu.backend import TpuTensor, array_of, dtypes

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
    """Write a torchtitan model (tpu tensors, any sharding) as a Hugging Face folder in its family's
    layout, with `tokenizer`'s files when given. Every process calls it (the gathers are collective); process 0
    writes."""
    import jax

    from .manager import canonical_name

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
