"""A model's tensors in Hugging Face's names and layouts, as its family's torchtitan adapter makes them.

torchtitan's state-dict adapters (`ModelFamily.hf_adapter`) convert whole state dicts: names,
Llama 3's q/k row permutation, Mixture-of-Experts weights split per expert (grouped `w1` of shape
(experts, hidden, dim) <-> `experts.{i}.gate_proj` of shape (hidden, dim)), tied output
projections left out. This module asks the adapter what it does, so that a loader reads only the
slices each device holds and a writer streams one tensor at a time:

* names and shapes: the adapter converts meta tensors (no data);
* where each row of a torchtitan tensor comes from: the adapter converts index tensors (each
  element holds its own index along one dimension; stride-0 views, so only an adapter that copies
  makes them take memory). A tensor whose Hugging Face tensors are its rows, permuted or not, or
  its slices along the first dimension (experts) is read in slices; any other layout (tensors
  fused from several) is converted whole by the adapter, one group of tensors at a time.

Written values are the adapter's own output (`to_hf`); sliced reads follow the row maps derived
from it, which `from_hf` inverts.

    layout = HFLayout(model_args)                  # the family found from the arguments' class
    layout.hf_shapes                               # {Hugging Face name: shape}, in writing order
    layout.units                                   # [(torchtitan names, Hugging Face names)] to write
    layout.to_hf({name: tensor, ...})              # one unit's Hugging Face tensors (the adapter's)
    layout.read(name, index, read)                 # torchtitan tensor[index] from Hugging Face slices
    layout.hf_config(dtype)                        # config.json (the family's torchtpu.models.<name>.hf)
"""

from __future__ import annotations

import importlib
import re

import numpy as np
import torch

__all__ = ["HFLayout", "HFLayoutError", "family_for_args"]


class HFLayoutError(ValueError):
    """The family has no Hugging Face adapter, or its adapter cannot place a tensor; one line."""


def family_for_args(model_args):
    """The registered family whose flavor table holds arguments of `model_args`' class."""
    from .registry import FAMILIES, resolve

    for family in FAMILIES.values():
        if any(type(a) is type(model_args) for a in resolve(family.args_table).values()):
            return family
    raise HFLayoutError(f"{type(model_args).__name__} are no registered family's model arguments")


def _abstract(name: str) -> str:
    """The name with its layer/expert numbers (whole dotted components) blanked."""
    return re.sub(r"(?<![^.])\d+(?![^.])", "#", name)


class HFLayout:
    """The Hugging Face layout of the model `model_args` describe, from its family's adapter."""

    def __init__(self, model_args, family=None):
        self.family = family or family_for_args(model_args)
        if not self.family.hf_adapter:
            from .registry import FAMILIES

            have = [n for n, f in FAMILIES.items() if f.hf_adapter]
            raise HFLayoutError(
                f"model family {self.family.name!r} has no Hugging Face state-dict adapter; "
                f"families with Hugging Face weights: {', '.join(have)}"
            )
        from .registry import resolve

        self.model_args = model_args
        self.adapter = resolve(self.family.hf_adapter)(model_args, None)
        with torch.device("meta"):
            model = self.family.torchtitan_model(model_args)
        own = model.state_dict(keep_vars=True)
        params = {id(p) for p in model.parameters()}
        self.shapes: dict[str, tuple[int, ...]] = {k: tuple(v.shape) for k, v in own.items()}
        first: dict[int, str] = {}
        self.aliases: dict[str, str] = {}  # tied tensor -> the name it shares storage with
        for k, v in own.items():
            if id(v) in first:
                self.aliases[k] = first[id(v)]
            else:
                first[id(v)] = k
        self.parameters = {k for k, v in own.items() if id(v) in params and k not in self.aliases}
        del model, own
        self._build()

    def check_readable(self) -> None:
        """HFLayoutError (one line) when a parameter has no Hugging Face tensor to be read from (a
        buffer without one, Qwen3 MoE's expert_bias, keeps its value)."""
        lost = [k for k in self.dropped if k in self.parameters]
        if lost:
            raise HFLayoutError(
                f"{type(self.adapter).__name__} has no Hugging Face tensor for {len(lost)} parameter(s) of the "
                f"model ({', '.join(lost[:3])}{' ...' if len(lost) > 3 else ''}): its Hugging Face weights cannot "
                "be loaded into it"
            )

    # ------------------------------------------------------------------------------ discovery

    def _to_hf(self, tensors: dict) -> dict:
        try:
            return self.adapter.to_hf(dict(tensors))
        except Exception as e:  # noqa: BLE001  (the adapter's KeyError/assertion on a name it does not know)
            raise HFLayoutError(
                f"{type(self.adapter).__name__} cannot convert {', '.join(tensors)} ({type(e).__name__}: {e})"
            ) from None

    def _build(self) -> None:
        meta = {k: torch.empty(s, device="meta") for k, s in self.shapes.items() if k not in self.aliases}
        singles: dict[str, dict[str, tuple]] = {}
        failed: dict[str, HFLayoutError] = {}  # tensors the adapter converts only together with others
        for k, t in meta.items():
            try:
                singles[k] = {h: tuple(v.shape) for h, v in self._to_hf({k: t}).items()}
            except HFLayoutError as e:
                singles[k], failed[k] = {}, e
        produced = {h: k for k, out in singles.items() for h in out}
        whole = {h: tuple(v.shape) for h, v in self._to_hf(meta).items()}
        # Hugging Face tensors made of several torchtitan tensors (absent from the one-tensor calls)
        groups: list[tuple[set, set]] = []
        for h, shape in whole.items():
            if h in produced:
                continue
            try:
                tts = set(self.adapter.from_hf({h: torch.empty(shape, device="meta")}))
            except Exception:  # noqa: BLE001
                tts = set()
            tts = {self.aliases.get(t, t) for t in tts}
            if not tts:
                raise HFLayoutError(f"{type(self.adapter).__name__} writes {h} but names no model tensor it comes from")
            groups.append((tts, {h}))
        # each torchtitan tensor: rows from Hugging Face tensors, or part of a group converted whole
        self._rows: dict[str, tuple[list[str], np.ndarray, np.ndarray]] = {}
        probe_cache: dict[tuple, list | None] = {}
        for k, out in singles.items():
            if not out:
                continue
            key = (_abstract(k), self.shapes[k])
            if key not in probe_cache:
                probe_cache[key] = self._probe(k, meta[k].shape, out)
            recipe = probe_cache[key]
            if recipe is None:
                groups.append(({k}, set(out)))
                continue
            names = list(out)
            part = np.empty(self.shapes[k][0] if self.shapes[k] else 1, dtype=np.int64)
            row = np.empty_like(part)
            for i, (pos, rows) in enumerate(recipe):
                part[rows[0]] = i
                row[rows[0]] = rows[1]
                assert pos == i
            self._rows[k] = (names, part, row)
        # merge groups that share a tensor
        merged: list[tuple[set, set]] = []
        for tts, hfs in groups:
            for g in [g for g in merged if g[0] & tts or g[1] & hfs]:
                merged.remove(g)
                tts, hfs = tts | g[0], hfs | g[1]
            merged.append((tts, hfs))
        for tts, _ in merged:
            for t in tts:
                self._rows.pop(t, None)
        self.groups = merged
        grouped = {t for tts, _ in merged for t in tts}
        for k, e in failed.items():
            if k not in grouped:
                raise e
        self.dropped = [k for k in meta if k not in self._rows and k not in grouped]  # no Hugging Face tensor
        # writing order: the model's, each unit where its first tensor stands
        self.units: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
        done: set = set()
        for k in meta:
            if k in done or k in self.dropped:
                continue
            g = next((g for g in merged if k in g[0]), None)
            if g is None:
                self.units.append(((k,), tuple(singles[k])))
                done.add(k)
            else:
                tts = tuple(t for t in meta if t in g[0])
                self.units.append((tts, tuple(h for h in whole if h in g[1] or produced.get(h) in g[0])))
                done.update(tts)
        self.hf_shapes = {h: whole[h] for _, hfs in self.units for h in hfs}
        self.hf_to_tt = {h: tts for tts, hfs in self.units for h in hfs}

    def _probe(self, name: str, shape, out: dict) -> list | None:
        """For each Hugging Face tensor the adapter makes of `name`, in its order: (position, (torchtitan
        rows, its rows or -1 for the whole tensor)); None when the layout is not rows of `name`."""
        d = len(shape)
        if d == 0:
            return [(0, (np.array([0]), np.array([-1])))] if len(out) == 1 else None
        probes, bases = [], []
        for k in range(d):
            view = [1] * d
            view[k] = shape[k]
            n = shape[k]  # the narrowest integer type that holds the indices: an adapter that copies copies less
            base = torch.arange(n, dtype=torch.int16 if n <= 2**15 else torch.int32 if n <= 2**31 else torch.int64)
            got = self._to_hf({name: base.reshape(view).expand(tuple(shape))})
            if list(got) != list(out):
                return None
            probes.append(got)
            bases.append(base)
        covered = np.zeros(shape[0], dtype=np.int64)
        recipe = []
        for pos, h in enumerate(out):
            idx = [p[h] for p in probes]
            hs = tuple(idx[0].shape)
            if len(hs) == d:
                for k in range(1, d):
                    if hs[k] != shape[k] or not _is_arange(idx[k], k, bases[k]):
                        return None
                tt_rows = _rows_of(idx[0], bases[0])
                if tt_rows is None:
                    return None
                recipe.append((pos, (tt_rows, np.arange(hs[0], dtype=np.int64))))
            elif len(hs) == d - 1:
                e = _constant(idx[0], bases[0])
                if e is None:
                    return None
                for k in range(1, d):
                    if hs[k - 1] != shape[k] or not _is_arange(idx[k], k - 1, bases[k]):
                        return None
                recipe.append((pos, (np.array([e]), np.array([-1]))))
            else:
                return None
            np.add.at(covered, recipe[-1][1][0], 1)
        if not np.all(covered == 1):
            return None
        return recipe

    # ------------------------------------------------------------------------------ values

    def to_hf(self, tensors: dict) -> dict:
        """The Hugging Face tensors of one unit's torchtitan tensors, as the adapter makes them."""
        return self._to_hf(tensors)

    def sliced(self, name: str) -> bool:
        """Whether `name` is read in slices (its Hugging Face tensors are its rows)."""
        return name in self._rows

    def sources(self, name: str) -> tuple[str, ...]:
        """The Hugging Face tensors `name` is made from."""
        name = self.aliases.get(name, name)
        if name in self._rows:
            return tuple(self._rows[name][0])
        for tts, hfs in self.units:
            if name in tts:
                return hfs
        return ()

    def read(self, name: str, index: tuple, read) -> torch.Tensor:
        """torchtitan tensor `name`[index] (a tuple of unit-step slices) for a sliced tensor;
        read(hf_name, index) returns that Hugging Face tensor's slice."""
        names, part, row = self._rows[name]
        shape = self.shapes[name]
        if not shape:
            return read(names[0], ())
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        lo, hi, _ = index[0].indices(shape[0])
        rest = index[1:]
        p, r = part[lo:hi], row[lo:hi]
        cuts = [0, *(np.flatnonzero(np.diff(p)) + 1).tolist(), hi - lo]
        pieces = []
        for a, b in zip(cuts[:-1], cuts[1:]):
            h = names[p[a]]
            if r[a] < 0:  # the Hugging Face tensor is this one whole row (an expert): a run of one
                pieces.append(read(h, rest).unsqueeze(0))
                continue
            rows = r[a:b]
            first, last = int(rows.min()), int(rows.max()) + 1
            block = read(h, (slice(first, last), *rest))
            if not np.array_equal(rows, np.arange(first, last)):
                block = block[torch.from_numpy(rows - first)]
            pieces.append(block)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def from_hf_group(self, tensors: dict) -> dict:
        """A group's torchtitan tensors from all its Hugging Face tensors (the adapter's from_hf)."""
        try:
            out = self.adapter.from_hf(dict(tensors))
        except Exception as e:  # noqa: BLE001
            raise HFLayoutError(f"{type(self.adapter).__name__} cannot read {', '.join(tensors)} ({e})") from None
        return {self.aliases.get(k, k): v for k, v in out.items()}

    def unknown(self, hf_name: str, shape) -> bool:
        """True when a Hugging Face tensor has no place in this model; False when the adapter
        drops it or maps it onto a tied tensor (a separate lm_head of a tied model)."""
        if hf_name in self.hf_shapes:
            return False
        try:
            out = self.adapter.from_hf({hf_name: torch.empty(tuple(shape), device="meta")})
        except Exception:  # noqa: BLE001
            return True
        return any(k not in self.aliases and k not in self.dropped for k in out)

    # ------------------------------------------------------------------------------ config.json

    def _config_module(self):
        try:
            return importlib.import_module(f"torchtpu.models.{self.family.name}.hf")
        except ModuleNotFoundError:
            raise HFLayoutError(
                f"model family {self.family.name!r} has no config.json writer (torchtpu.models.{self.family.name}.hf)"
            ) from None

    def hf_config(self, dtype: str) -> dict:
        """config.json for transformers' class of this family, computing what the model computes."""
        return self._config_module().hf_config(self.model_args, dtype)

    def check_hf_config(self, config: dict) -> None:
        """ValueError (one line) when `config` computes differently from the model in a way the
        tensor shapes do not show."""
        self._config_module().check_hf_config(config, self.model_args)


# Probe outputs are usually views of the probe's own index vector (the adapter only re-views it):
# their values then follow from offset and strides, without reading every element.


def _view_of(t: torch.Tensor, base: torch.Tensor):
    if t.numel() and t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
        return t.storage_offset(), [s if n > 1 else 0 for n, s in zip(t.shape, t.stride())]
    return None


def _is_arange(t: torch.Tensor, k: int, base: torch.Tensor) -> bool:
    """Whether t[..., i (dimension k), ...] == i everywhere."""
    v = _view_of(t, base)
    if v is not None:
        off, st = v
        return off == 0 and all(s == (1 if i == k and t.shape[k] > 1 else 0) for i, s in enumerate(st))
    view = [1] * t.ndim
    view[k] = t.shape[k]
    return bool((t == torch.arange(t.shape[k], dtype=t.dtype).reshape(view)).all())


def _constant(t: torch.Tensor, base: torch.Tensor) -> int | None:
    """The one value t holds everywhere, or None."""
    v = _view_of(t, base)
    if v is not None:
        off, st = v
        return off if not any(st) else None
    e = int(t.reshape(-1)[0]) if t.numel() else 0
    return e if bool((t == e).all()) else None


def _rows_of(t: torch.Tensor, base: torch.Tensor) -> np.ndarray | None:
    """r with t[j, ...] == r[j] everywhere, or None when a row holds several values."""
    v = _view_of(t, base)
    if v is not None:
        off, st = v
        if any(st[1:]):
            return None
        return off + np.arange(t.shape[0], dtype=np.int64) * st[0]
    flat = t.reshape(t.shape[0], -1)
    rows = flat[:, :1]
    return rows[:, 0].numpy().astype(np.int64) if bool((flat == rows).all()) else None
