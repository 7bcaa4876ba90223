"""The optimizer of [optimizer]: AdamW or Adam with its learning rate held in a tpu tensor, so the
LR schedule (lr.py) reaches a compiled step without recompiling it, and its state created up front
so a checkpoint can be restored into it in place.
"""

from __future__ import annotations

from .job_config import JobConfig

__all__ = ["build_optimizer", "init_optimizer_state"]


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
