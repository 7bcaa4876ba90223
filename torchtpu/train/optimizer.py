"""The optimizer of [optimizer]: AdamW or Adam with its learning rate held in a tpu tensor, so the
LR schedule (lr.py) reaches a compiled step without recompiling it, and its state created up front
so a checkpoint can be restored into it in place.
"""

from __future__ import annotations

from .config.job_config import JobConfig

__all__ = [
    "build_optimizer",
    "init_optimizer_state",
    "track_stacked_state",
    "per_parameter_state",
    "stacked_state",
]


def _scalar(value: float, mesh=None, lazy: bool = False):
    """A float32 scalar on tpu: replicated over `mesh` when given (so it can meet sharded tensors in
    eager ops even after a checkpoint restore commits it), else on the default tpu device.
    lazy=True: an unfilled tensor laid out over the mesh (for ahead-of-time compilation)."""
    import torch

    from torchtpu.distributed import Replicate, distribute_tensor, empty

    if lazy:
        return empty((), torch.float32, mesh=mesh, placements=[Replicate()] * mesh.ndim)
    t = torch.tensor(value, dtype=torch.float32)
    if mesh is None:
        return t.to("tpu")
    return distribute_tensor(t, mesh, [Replicate()] * mesh.ndim)


def build_optimizer(params, cfg: JobConfig, mesh=None, lazy: bool = False):
    """AdamW/Adam from [optimizer], capturable, foreach, with the learning rate as a tpu tensor.

    A Python-float learning rate would be baked into a compiled step as a constant; a tensor is
    an input of the program, and LambdaLR updates it in place (fill_)."""
    import torch

    o = cfg.optimizer
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[o.name]
    kw = dict(betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, capturable=True, foreach=True)
    if lazy:
        # the constructor reads lr to check it; give it the number, then the unfilled tensor
        opt = cls(params, lr=o.lr, **kw)
        for group in opt.param_groups:
            group["lr"] = _scalar(o.lr, mesh, lazy=True)
        return opt
    return cls(params, lr=_scalar(o.lr, mesh), **kw)


def init_optimizer_state(optimizer, mesh=None) -> None:
    """Create Adam(W)'s state (step, exp_avg, exp_avg_sq) now, laid out like each parameter,
    instead of lazily in the first step, so a checkpoint can be restored into it in place."""
    import torch

    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            st = optimizer.state[p]
            st["step"] = _scalar(0.0, mesh)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# ----------------------------------------------------------------------------- stacked slots
# With the layer scan, the optimizer updates each stacked parameter slot of the scanned blocks as
# one tensor (distributed.scan.optimizer_parameters), so its own state_dict() has one entry of
# shape [n_blocks, *shape] per slot. Checkpoints keep the per-parameter format of an optimizer
# over model.parameters() (what a job without the scan writes and reads): per_parameter_state
# presents the state so, with block i's entries the views of row i (a save reads them, a restore
# fills them in place), and stacked_state turns a restored per-parameter state back.

_STACKED = "_torchtpu_stacked"


def track_stacked_state(optimizer, model_params, groups) -> None:
    """Remember, on `optimizer`, which model parameters its stacked tensors stand for."""
    setattr(optimizer, _STACKED, (list(model_params), list(groups)))


def _single_group(optimizer):
    if len(optimizer.param_groups) != 1:
        raise NotImplementedError(
            "an optimizer over stacked layer-scan parameters has one param group; with several, "
            "turn the layer scan off ([tpu] scan_layers = false)"
        )


def per_parameter_state(optimizer, sd: dict) -> dict:
    """`sd` (optimizer.state_dict()) in the format of the same optimizer over model.parameters()."""
    tracked = getattr(optimizer, _STACKED, None)
    if tracked is None:
        return sd
    _single_group(optimizer)
    model_params, groups = tracked
    row = {id(v): (base, i) for base, views in groups for i, v in enumerate(views)}
    state = {}
    for k, p in enumerate(model_params):
        hit = row.get(id(p))
        own = optimizer.state.get(hit[0] if hit else p)
        if not own:
            continue
        if hit is None:
            state[k] = dict(own)
            continue
        base, i = hit
        state[k] = {
            key: _row(v, i) if _is_stacked(v, base) else v  # `step` is shared by the slot's rows
            for key, v in own.items()
        }
    group = dict(sd["param_groups"][0], params=list(range(len(model_params))))
    return {"state": state, "param_groups": [group]}


def _row(v, i):
    """Row i of a stacked state tensor, its storage marked as rows (read and written by index,
    as the stacked parameters are: backend.views.run_chain)."""
    from torchtpu.backend import TpuTensor, storage_of

    if isinstance(v, TpuTensor):
        storage_of(v).rows = True
    return v.select(0, i)


def _is_stacked(v, base) -> bool:
    import torch

    return isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == tuple(base.shape)


def stacked_state(optimizer, sd: dict) -> dict:
    """A per-parameter optimizer state `sd` (per_parameter_state's format, or one saved without the
    layer scan) as optimizer.load_state_dict expects it for the stacked optimizer."""
    tracked = getattr(optimizer, _STACKED, None)
    if tracked is None:
        return sd
    import torch

    from torchtpu.backend import storage_of

    _single_group(optimizer)
    model_params, groups = tracked
    index = {id(p): k for k, p in enumerate(model_params)}
    views_of = {id(base): views for base, views in groups}
    given = sd["state"]
    if len(sd["param_groups"]) != 1 or len(sd["param_groups"][0]["params"]) != len(model_params):
        raise ValueError(
            f"the optimizer state has {sum(len(g['params']) for g in sd['param_groups'])} parameters in "
            f"{len(sd['param_groups'])} groups; this model has {len(model_params)} in one group"
        )
    state = {}
    opt_params = optimizer.param_groups[0]["params"]
    for j, q in enumerate(opt_params):
        views = views_of.get(id(q))
        if views is None:
            if index[id(q)] in given:
                state[j] = given[index[id(q)]]
            continue
        entries = [given.get(index[id(v)]) for v in views]
        if all(e is None for e in entries):
            continue
        if any(e is None for e in entries) or any(e.keys() != entries[0].keys() for e in entries):
            raise ValueError("the optimizer state covers some blocks of a scanned layer stack and not others")
        own = optimizer.state.get(q) or {}
        out = {}
        for key in entries[0]:
            vals = [e[key] for e in entries]
            if not (isinstance(vals[0], torch.Tensor) and vals[0].dim() > 0):
                # one value (the step) for all rows: they must agree
                if any(v is not vals[0] for v in vals) and len({float(v) for v in vals}) > 1:
                    raise ValueError(
                        f"the optimizer state's {key!r} differs between the blocks of a scanned layer stack "
                        f"({sorted({float(v) for v in vals})}); load it with the layer scan off "
                        "([tpu] scan_layers = false)"
                    )
                out[key] = vals[0]
                continue
            target = own.get(key)
            if target is not None and all(storage_of(v) is storage_of(target) for v in vals):
                out[key] = target  # the restore filled the rows in place
            else:
                out[key] = torch.stack(vals)
        state[j] = out
    group = dict(sd["param_groups"][0], params=list(range(len(opt_params))))
    return {"state": state, "param_groups": [group]}
