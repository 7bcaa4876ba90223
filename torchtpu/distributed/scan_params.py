"""The stacked parameters of scanned blocks (scan.py): each parameter slot of the blocks stored as one
[n_blocks, *shape] tensor whose row i is block i's Parameter (params._materialize_stacked), and the
optimizer's view of them: one tensor per slot, its gradient the stack of the blocks' gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from ..backend import TpuTensor, row_index, storage_of
from .params import module_record, scanned_children


def _rows_of(base: TpuTensor, views) -> bool:
    """Whether `views` are, in order, the rows of `base` (views[i] is base.select(0, i))."""
    return not base._vw and rows_of_storage(storage_of(base), views)


def rows_of_storage(st, views) -> bool:
    if tuple(st.shape) != (len(views), *tuple(views[0].shape)):
        return False
    return all(isinstance(v, TpuTensor) and storage_of(v) is st and row_index(v) == i for i, v in enumerate(views))


def stacked_parameters(model: nn.Module) -> list[tuple[TpuTensor, list]]:
    """(stacked storage tensor, the blocks' Parameters that are its rows) for every parameter slot
    of `model`'s scanned blocks that `materialize` stacked and that still are its rows."""
    out = []
    for mod in model.modules():
        rec = module_record(mod)
        if rec is None or not rec.stacked:
            continue
        children = scanned_children(mod, rec)
        for slot, base in rec.stacked.items():
            path, _, name = slot.rpartition(".")
            views = [c.get_submodule(path)._parameters.get(name) for c in children]
            if all(v is not None for v in views) and _rows_of(base, views):
                out.append((base, views))
    return out


def optimizer_parameters(model: nn.Module, groups=None) -> list:
    """`model.parameters()` with each stacked slot's block Parameters replaced, where the first of
    them stood, by the slot's stacked tensor (a leaf that `stack_gradients` gives a gradient): what
    an optimizer should update so that a compiled step holds one update per slot.

    Each stacked tensor's `requires_grad` is set to its rows' here, when the optimizer is built: a
    slot frozen after `materialize` (requires_grad_(False) on all its Parameters) is frozen in the
    optimizer too. A slot with frozen and trainable rows is refused: one update of the stacked
    tensor would also move the frozen rows (weight decay acts without a gradient)."""
    groups = stacked_parameters(model) if groups is None else groups
    for base, views in groups:
        if len({bool(v.requires_grad) for v in views}) > 1:
            frozen = [i for i, v in enumerate(views) if not v.requires_grad]
            raise ValueError(
                f"scan: the stacked parameter slot {tuple(base.shape)} mixes frozen blocks {frozen} with trainable "
                "ones; an optimizer over the stacked slots would update the frozen rows too. Freeze a slot in every "
                "block, or build the optimizer on model.parameters() (each block's own tensors)"
            )
    first = {id(views[0]): base for base, views in groups}
    rows = {id(v) for _, views in groups for v in views}
    out = []
    for p in model.parameters():
        if id(p) in first:
            base = first[id(p)]
            base.requires_grad_(p.requires_grad)
            out.append(base)
        elif id(p) not in rows:
            out.append(p)
    return out


def stack_gradients(groups, model: nn.Module | None = None) -> None:
    """Move the blocks' gradients of each stacked slot onto the slot's stacked tensor (its .grad
    becomes their stack; theirs becomes None), so the optimizer and gradient clipping see them as one.

    With `model`, first check that `groups` are still its stacked slots: an optimizer built on
    stacked tensors whose rows are not the model's parameters would update nothing the
    model uses."""
    if model is not None:
        now = {(id(b), tuple(map(id, vs))) for b, vs in stacked_parameters(model)}
        if now != {(id(b), tuple(map(id, vs))) for b, vs in groups}:
            raise RuntimeError(
                "the scanned blocks' parameters were replaced after the optimizer was built on their stacked "
                "storage; build the optimizer again (scan.optimizer_parameters) or write new values in place "
                "(load_state_dict without assign=True, copy_)"
            )
    for base, views in groups:
        grads = [v.grad for v in views]
        if all(g is None for g in grads):
            base.grad = None
            continue
        if any(g is None for g in grads):
            # a row without a gradient is one PyTorch's optimizer would skip; a zero in the stack
            # would still be decayed and moved by its moments
            missing = [i for i, g in enumerate(grads) if g is None]
            raise RuntimeError(
                f"scan: blocks {missing} of the stacked parameter slot {tuple(base.shape)} have no gradient while the "
                "others have one (frozen after the optimizer was built?); one stacked update cannot skip them. Freeze "
                "a slot in every block and build the optimizer again (scan.optimizer_parameters)"
            )
        base.grad = torch.stack(grads)
        for v in views:
            v.grad = None
