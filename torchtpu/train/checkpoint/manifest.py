"""How a training state is written as a checkpoint: its structure and Python values as a JSON
manifest, its arrays by readable names (for Orbax), and back.

A state is a nested structure (dicts, lists, tuples) whose leaves are tpu tensors (saved as their
`jax.Array`, each host writing its own shards), CPU tensors, NumPy arrays and scalars, plain
`jax.Array`s, or Python scalars, strings, bytes and None. The manifest records each array's kind,
dtype and shape, so shape and dtype mismatches are reported by key before any data is read.
"""

from __future__ import annotations

import base64
import re
from typing import Any

import jax
import numpy as np
import torch

from torchtpu.backend import TpuTensor, array_of, dtypes, write
from torchtpu.backend.transfer import from_jax

from .files import CheckpointError

__all__ = ["Encoder", "decode", "FORMAT_VERSION", "guess_key"]

FORMAT_VERSION = 1

# ----------------------------------------------------------------------------- encoding
# The manifest is a tree of tagged JSON nodes:
#   {"dict": [[key, node], ...]}  {"list": [node, ...]}  {"tuple": [node, ...]}
#   {"value": json scalar}        {"bytes": base64}
#   {"array": name, "kind": "tpu"|"cpu"|"numpy"|"npscalar"|"jax", "dtype": str, "shape": [...]}


def keystr(path) -> str:
    return "".join(f"[{k!r}]" for k in path) or "<root>"


def dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return np.dtype(dtype).name


def jax_dtype(name: str):
    t = getattr(torch, name, None)
    if isinstance(t, torch.dtype):
        return dtypes.to_jax_dtype(t)
    return np.dtype(name)


def torch_dtype(name: str) -> torch.dtype:
    t = getattr(torch, name, None)
    if not isinstance(t, torch.dtype):
        raise CheckpointError(f"checkpoint holds dtype {name!r} that torch does not know")
    return t


_NAME_BAD = re.compile(r"[^A-Za-z0-9_.-]")


class Encoder:
    def __init__(self):
        self.arrays: dict[str, Any] = {}

    def _name(self, path) -> str:
        base = _NAME_BAD.sub("_", ".".join(str(k) for k in path)) or "root"
        name, i = base, 1
        while name in self.arrays:
            name = f"{base}__{i}"
            i += 1
        return name

    def _array(self, path, value, kind, dtype, shape, extra=None) -> dict:
        name = self._name(path)
        self.arrays[name] = value
        node = {"array": name, "kind": kind, "dtype": dtype_name(dtype), "shape": list(shape)}
        if extra:
            node.update(extra)
        return node

    def encode(self, obj, path=()):
        if isinstance(obj, TpuTensor):
            a = array_of(obj)
            return self._array(path, a, "tpu", obj.dtype, obj.shape, {"requires_grad": bool(obj.requires_grad)})
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu":
                raise CheckpointError(
                    f"cannot checkpoint key {keystr(path)}: tensor on device {obj.device}; "
                    "move it to 'tpu' or 'cpu' first"
                )
            a = np.array(dtypes.torch_to_numpy(obj.detach()), copy=True)  # later writes must not show
            return self._array(path, a, "cpu", obj.dtype, obj.shape, {"requires_grad": bool(obj.requires_grad)})
        if isinstance(obj, jax.Array):
            return self._array(path, obj, "jax", obj.dtype, obj.shape)
        if isinstance(obj, np.ndarray):
            return self._array(path, np.array(obj, copy=True), "numpy", obj.dtype, obj.shape)
        if isinstance(obj, np.generic):
            return self._array(path, np.asarray(obj), "npscalar", obj.dtype, ())
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return {"value": obj}
        if isinstance(obj, bytes):
            return {"bytes": base64.b64encode(obj).decode("ascii")}
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                if not (k is None or isinstance(k, (bool, int, float, str))):
                    raise CheckpointError(
                        f"cannot checkpoint key {keystr(path + (k,))}: dict keys must be str, int, float, "
                        f"bool or None, got {type(k).__name__}"
                    )
                items.append([k, self.encode(v, path + (k,))])
            return {"dict": items}
        if isinstance(obj, (list, tuple)):
            tag = "tuple" if isinstance(obj, tuple) else "list"
            return {tag: [self.encode(v, path + (i,)) for i, v in enumerate(obj)]}
        raise CheckpointError(
            f"cannot checkpoint key {keystr(path)}: unsupported type {type(obj).__module__}.{type(obj).__qualname__}; "
            "use tensors, arrays, Python scalars/strings or dicts/lists of them (e.g. call .state_dict())"
        )


def child(target, key):
    """target[key] for a dict/list/tuple target, or MISSING."""
    if isinstance(target, dict):
        return target.get(key, MISSING)
    if isinstance(target, (list, tuple)) and isinstance(key, int) and 0 <= key < len(target):
        return target[key]
    return MISSING


MISSING = object()


def array_nodes(node, path=()):
    """(path, node) for every array node of a manifest tree."""
    if "array" in node:
        yield path, node
    elif "dict" in node:
        for k, v in node["dict"]:
            yield from array_nodes(v, path + (k,))
    elif "list" in node or "tuple" in node:
        for i, v in enumerate(node.get("list", node.get("tuple"))):
            yield from array_nodes(v, path + (i,))


def children(node) -> dict | list:
    """The children of a manifest container node as a dict (or list), for `child`."""
    if "dict" in node:
        return {k: v for k, v in node["dict"]}
    return list(node.get("list", node.get("tuple", [])))


def tensor_leaves(obj, path=()):
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensor_leaves(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensor_leaves(v, path + (i,))


def decode(node, arrays, placed):
    if "array" in node:
        name = node["array"]
        a = arrays[name]
        t = placed.get(name)
        kind = node["kind"]
        if isinstance(t, TpuTensor):
            write(t, a if isinstance(a, jax.Array) else jax.device_put(a, array_of(t).sharding))
            return t
        if isinstance(t, torch.Tensor):  # CPU tensor target: copy in place
            with torch.no_grad():
                t.copy_(dtypes.numpy_to_torch(np.asarray(a), t.dtype))
            return t
        if kind == "tpu":
            if not isinstance(a, jax.Array):
                a = jax.device_put(a, jax.local_devices()[0])
            r = from_jax(a)
            if node.get("requires_grad"):
                r.requires_grad_(True)
            return r
        if kind == "cpu":
            r = dtypes.numpy_to_torch(np.array(a, copy=True), torch_dtype(node["dtype"]))
            if node.get("requires_grad"):
                r.requires_grad_(True)
            return r
        if kind == "jax":
            return a if isinstance(a, jax.Array) else jax.numpy.asarray(a)
        if kind == "npscalar":
            return np.asarray(a).reshape(())[()]
        return np.asarray(a)
    if "value" in node:
        return node["value"]
    if "bytes" in node:
        return base64.b64decode(node["bytes"])
    if "dict" in node:
        return {k: decode(v, arrays, placed) for k, v in node["dict"]}
    if "tuple" in node:
        return tuple(decode(v, arrays, placed) for v in node["tuple"])
    if "list" in node:
        return [decode(v, arrays, placed) for v in node["list"]]
    raise CheckpointError(f"unknown manifest node {sorted(node)}")


def guess_key(e: BaseException, nodes) -> str:
    text = str(e)
    for kpath, node in nodes:
        if re.search(rf"(?<![A-Za-z0-9_.-]){re.escape(node['array'])}(?![A-Za-z0-9_.-])", text):
            return keystr(kpath)
    return "arrays"
