"""`torch.load(f, map_location="tpu")`: a checkpoint loads onto the tpu device.

PyTorch restores each stored storage on the device `map_location` names by allocating a storage
there, which needs the device's C++ allocator; a Python backend has none, and the allocation ends
the process (a segfault). For a map_location that names tpu (a string, a torch.device, or a dict
whose targets are all tpu), torch.load here reads the file onto the CPU and moves every tensor of
the result to that device, keeping the objects' structure, Parameters as Parameters and one tpu
tensor for each CPU tensor the file holds several references to (tied weights stay tied). A
callable map_location is the user's own and is passed through.
"""

from __future__ import annotations

import collections
import functools
import inspect

import torch

# PyTorch's own torch.load (the autoload's stand-in, torchtpu_autoload._route_load, wraps it)
_torch_load = inspect.unwrap(torch.load)


def _tpu_target(map_location) -> torch.device | None:
    if isinstance(map_location, str) and map_location.startswith("tpu"):
        return torch.device(map_location)
    if isinstance(map_location, torch.device) and map_location.type == "tpu":
        return map_location
    if isinstance(map_location, dict) and map_location:
        targets = {torch.device(v) for v in map_location.values()}
        if len(targets) == 1 and next(iter(targets)).type == "tpu":
            return next(iter(targets))
    return None


def _move(obj, device, memo: dict):
    key = id(obj)
    if key in memo:
        return memo[key]
    if isinstance(obj, torch.nn.Parameter):
        out = torch.nn.Parameter(obj.detach().to(device), requires_grad=obj.requires_grad)
    elif isinstance(obj, torch.Tensor):
        out = obj.to(device)
    elif isinstance(obj, collections.OrderedDict):
        out = type(obj)((k, _move(v, device, memo)) for k, v in obj.items())
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata  # state dicts carry their modules' versions
    elif isinstance(obj, dict):
        out = type(obj)({k: _move(v, device, memo) for k, v in obj.items()})
    elif isinstance(obj, list):
        out = [_move(v, device, memo) for v in obj]
    elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        out = tuple(_move(v, device, memo) for v in obj)
    else:
        return obj
    memo[key] = out
    return out


@functools.wraps(_torch_load)
def load(f, map_location=None, *args, **kwargs):
    device = _tpu_target(map_location)
    if device is None:
        return _torch_load(f, map_location, *args, **kwargs)
    return _move(_torch_load(f, "cpu", *args, **kwargs), device, {})


def install() -> None:
    if torch.load is not load:
        torch.load = load
        torch.serialization.load = load
