"""Activation checkpointing (rematerialisation) for tpu programs.

PyTorch's own non-reentrant `torch.utils.checkpoint` drops a block's activations after the
forward and recomputes them during backward. Inside a compiled torchtpu step, forward and
recomputation end up in one XLA program, where XLA would merge the recomputation with the
original forward (common subexpression elimination) and keep the activations alive after
all. The recomputation therefore starts from its inputs passed through an XLA optimization
barrier, as jax.checkpoint does, which keeps the two computations apart.

The recomputation also runs under the torch function modes the forward ran under (PyTorch's
checkpoint restores the RNG and autocast state, not those, and the autograd engine runs backward
without the caller's modes even when backward() is called inside them): without that, a mode
such as `loss_parallel` around the loss is gone when backward recomputes, and the recomputation
would compute something else (see _forward_function_modes).

Per-op selective checkpointing (mode "op", torchtitan's `selective_ac_option = "op"`) recomputes a
block but keeps the outputs of the ops `OpPolicy` names (matmuls, attention, ...), through
PyTorch's `create_selective_checkpoint_contexts`; the layer scan does the same with its own
recording and replaying modes (distributed/scan.py), on the same policy.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint
from jax import lax
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .optable import lower

aten = torch.ops.aten

_lib = torch.library.Library("torchtpu", "DEF")
_lib.define("optimization_barrier(Tensor[] xs) -> Tensor[]")


def _barrier_cpu(xs):
    return [x.clone() for x in xs]


_lib.impl("optimization_barrier", _barrier_cpu, "CompositeExplicitAutograd")


@torch.library.register_fake("torchtpu::optimization_barrier")
def _barrier_fake(xs):
    return [torch.empty_like(x) for x in xs]


def _barrier_backward(ctx, grads):
    return list(grads)


torch.library.register_autograd("torchtpu::optimization_barrier", _barrier_backward)

# The barrier runs in the recomputation only (see _Checkpointed.forward): PyTorch's selective
# checkpointing, which replays the forward's ops by position, must pass it through as it passes the
# detaches that checkpointing adds, instead of looking for it among the forward's ops.
torch.utils.checkpoint.SAC_IGNORED_OPS.add(torch.ops.torchtpu.optimization_barrier.default)


@lower(torch.ops.torchtpu.optimization_barrier.default)
def optimization_barrier(xs):
    return list(lax.optimization_barrier(tuple(xs)))


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _barrier_tensors(args):
    # Only inputs that require grad (the activations) pass the barrier: constants such as a
    # rotary table need none (the recomputation already starts from barriered activations),
    # and a barrier output that needs no grad aborts PyTorch's autograd engine during
    # recomputation (seen with complex and with float32 rotary tables).
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.device.type == "tpu" and a.requires_grad]
    if not idx:
        return args
    out = torch.ops.torchtpu.optimization_barrier([args[i] for i in idx])
    args = list(args)
    for i, t in zip(idx, out):
        args[i] = t
    return tuple(args)


def _strip_wrapper(module, state_dict, prefix, local_metadata):
    # state_dict() names stay the wrapped module's own (checkpoints do not depend on whether
    # activation checkpointing, or the layer scan that replaces it, was on); order is kept
    inner = prefix + "module."
    items = [(prefix + k[len(inner) :] if k.startswith(inner) else k, v) for k, v in state_dict.items()]
    state_dict.clear()
    state_dict.update(items)
    return state_dict


def _add_wrapper(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    inner = prefix + "module."
    for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + k[len(prefix) :]] = state_dict.pop(k)


def _function_modes() -> tuple:
    return tuple(torch.overrides._get_current_function_mode_stack())


@contextlib.contextmanager
def _forward_function_modes(modes: tuple):
    """Context of a recomputation: enters the torch function modes that were active when the
    forward ran and are not active now, innermost last, as they were.

    Without it, F.cross_entropy under `loss_parallel` (a TorchFunctionMode) computes the
    vocab-parallel loss in forward but the plain one when backward recomputes it: other saved
    tensors, so torch.utils.checkpoint raises a CheckpointError from inside the autograd engine.
    On tpu that error cannot even be reported: it unwinds through the engine's stream guard,
    whose destructor calls back into the Python-registered PrivateUse1 device guard, and the
    process aborts ("terminate called without an active exception")."""
    active = {id(m) for m in _function_modes()}
    with contextlib.ExitStack() as stack:
        for mode in modes:
            if id(mode) not in active:
                stack.enter_context(mode)
        yield


# The ops whose outputs per-op selective checkpointing keeps (torchtitan's op save list, as far as
# its ops reach the dispatcher on tpu): matmuls, attention, the reduce-scatters of tensor
# parallelism, and max (the absolute maximum of low-precision scaling).
OP_SAC_SAVED = frozenset(
    {
        aten.mm.default,
        # F.scaled_dot_product_attention on tpu (ops/nn.py: _sdpa_autograd); the math path is
        # composite and reaches the dispatcher as its pieces, which are recomputed
        aten._scaled_dot_product_fused_attention_overrideable.default,
        aten._scaled_dot_product_attention_math.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        aten.max.default,
    }
)


# torchtitan's default `per_op_sac_force_recompute_mm_shapes_by_fqns`: a matmul whose weight has the
# shape of a linear layer so named (a MoE router's gate) is always recomputed, and not counted
FORCE_RECOMPUTE_MM_FQNS = ("moe.router.gate",)


def force_recompute_shapes(block: torch.nn.Module) -> frozenset:
    """The (in, out) shapes of the right-hand sides of the matmuls per-op checkpointing recomputes in
    `block` whatever their position: those of its nn.Linear layers whose names contain one of
    FORCE_RECOMPUTE_MM_FQNS, as torchtitan matches them (any matmul of that shape, the layer's or not)."""
    return frozenset(
        (m.in_features, m.out_features)
        for name, m in block.named_modules()
        if isinstance(m, torch.nn.Linear) and any(f in name for f in FORCE_RECOMPUTE_MM_FQNS)
    )


class OpPolicy:
    """torchtitan's per-op selective checkpointing policy, for one run of one block: keep the
    outputs of the ops in OP_SAC_SAVED, except every second `aten.mm` (the 2nd, 4th, ... of the
    block), and recompute everything else. A matmul whose right-hand side has one of
    `recompute_shapes` (`force_recompute_shapes`: a MoE router's gate) is recomputed and not
    counted, as torchtitan's default `per_op_sac_force_recompute_mm_shapes_by_fqns` does.

    Matmuls are `aten.mm` because that is what torchtitan's blocks' linear layers dispatch on
    tpu, as on CUDA: nn.Linear without a bias (every torchtitan block's) reaches the dispatcher as
    `aten.mm` (a 3-D input as view, mm, _unsafe_view: `aten.linear` and `aten.matmul` are
    composite and never reach it). A linear layer with a bias dispatches `aten.addmm`, which
    torchtitan's list does not name either; it is recomputed, as it is there.

    The matmuls are counted per run of the block (a fresh policy per forward and one per
    recomputation), so the forward and its recomputation pick the same ones and the choice is the
    same in every step."""

    def __init__(self, recompute_shapes: frozenset = frozenset()):
        self.mm = 0
        self.recompute_shapes = recompute_shapes

    def saves(self, func, args=()) -> bool:
        if func not in OP_SAC_SAVED:
            return False
        if func is aten.mm.default:
            if self.recompute_shapes and len(args) > 1 and tuple(args[1].shape) in self.recompute_shapes:
                return False
            self.mm += 1
            return self.mm % 2 == 1
        return True


def _op_sac_contexts(recompute_shapes: frozenset = frozenset()):
    """PyTorch's selective checkpoint contexts (forward, recomputation) on OpPolicy.

    A recomputation that runs other ops than the forward did makes PyTorch's recomputation context
    raise ("... encountered during backward but not found in storage"), from inside the autograd
    engine: on tpu that error aborts the process as a CheckpointError does (see
    _forward_function_modes), never a wrong tensor. The layer scan's own replay raises a ScanError."""
    # the forward's and the recomputation's count
    policies = {False: OpPolicy(recompute_shapes), True: OpPolicy(recompute_shapes)}

    def policy(ctx, func, *args, **kwargs):
        saves = policies[ctx.is_recompute].saves(func, args)
        return CheckpointPolicy.MUST_SAVE if saves else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


@contextlib.contextmanager
def _entered(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


class _Checkpointed(torch.nn.Module):
    """Wraps a module so its activations are recomputed in backward. Its state_dict() has the
    wrapped module's names (no wrapper prefix). With `save_ops`, the recomputation reuses the
    forward's outputs of the ops OpPolicy keeps (per-op selective checkpointing)."""

    def __init__(self, module: torch.nn.Module, save_ops: bool = False):
        super().__init__()
        self.module = module
        self.save_ops = save_ops
        self.recompute_shapes = force_recompute_shapes(module) if save_ops else frozenset()
        self._register_state_dict_hook(_strip_wrapper)
        self._register_load_state_dict_pre_hook(_add_wrapper)

    def __getattr__(self, name):
        # the wrapped block's own methods and attributes (torchtitan's init_weights) stay reachable
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)

    def forward(self, *args, **kwargs):
        def run(*a):
            if _in_backward():
                a = _barrier_tensors(a)
            return self.module(*a, **kwargs)

        modes = _function_modes()

        def contexts():
            if not self.save_ops:
                return contextlib.nullcontext(), _forward_function_modes(modes)
            forward, recompute = _op_sac_contexts(self.recompute_shapes)
            return forward, _entered(_forward_function_modes(modes), recompute)

        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, context_fn=contexts)


def is_checkpointed(module: torch.nn.Module) -> bool:
    """Whether `module` is wrapped by checkpoint_module: its forward runs again in backward."""
    return isinstance(module, _Checkpointed)


def checkpoint_module(module: torch.nn.Module, save_ops: bool = False) -> torch.nn.Module:
    """Return `module` wrapped so that its activations are recomputed during backward; with
    `save_ops`, all but the outputs of the ops OpPolicy keeps."""
    return _Checkpointed(module, save_ops)


AC_MODES = ("none", "full", "selective", "op")
# the modes that recompute every block, which the layer scan's own recomputation stands in for
EVERY_BLOCK_AC_MODES = ("full", "op")


def apply_activation_checkpointing(blocks: torch.nn.Module, mode: str = "full", every: int = 1) -> None:
    """Checkpoint the children of `blocks` (a ModuleDict/ModuleList/Sequential of layers).

    mode="full": every block; mode="selective": every `every`-th block (torchtitan's
    layer-selective policy); mode="op": every block, keeping the outputs of the ops OpPolicy
    names (torchtitan's per-op selective policy); mode="none": nothing.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is not one of {', '.join(map(repr, AC_MODES))}")
    if mode == "selective" and every < 1:
        raise ValueError(f"selective activation checkpointing needs every >= 1, got {every}")
    if mode == "none":
        return
    step = every if mode == "selective" else 1
    for i, (name, child) in enumerate(list(blocks.named_children())):
        if i % step == step - 1:
            setattr(blocks, name, checkpoint_module(child, save_ops=mode == "op"))
