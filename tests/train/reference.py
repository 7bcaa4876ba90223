"""The CPU oracle of the trainer tests: the job a `Trainer` runs, as a plain PyTorch loop on the CPU.

    init = cpu_state(trainer.model)                 # the trainer's initial weights, gathered
    losses = reference_losses(cfg, init, steps)     # same model, weights, batches, AdamW, LR, clipping

The model is torchtitan's own class for [model] name (torchtpu.models.registry), built on the CPU,
and the optimizer the one torchtitan's TrainSpec for it builds (with DeepSeek-V3's and Llama 4's
expert-bias update before each step).
Two things differ from a CUDA run of it, neither changing a number: its Mixture-of-Experts layers
(if any) run the grouped matmul on unpadded groups of tokens (torchtpu.models.moe: the padding is a
triton kernel, CUDA only), and `torch.histc` of the router's integer expert ids, which PyTorch's CPU
kernel refuses, counts them as floats (a shim of this module, never the model's).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.overrides import TorchFunctionMode


def cpu_state(model):
    """Full (gathered) CPU copies of a tpu model's parameters, by name."""
    import re

    out = {}
    for name, p in model.named_parameters():
        # activation checkpointing's wrappers (PyTorch's, torchtpu's) add a level to the block's names
        name = re.sub(r"^layers\.(\w+)\.module\.", r"layers.\1.", name.replace("_checkpoint_wrapped_module.", ""))
        out[name] = p.detach().cpu().clone()
    return out


class IntegerHistc(TorchFunctionMode):
    """torch.histc of integer CPU tensors (CUDA has it, the CPU kernel does not): the same counts,
    binned as floats (exact for the small integers an MoE router counts), in the input's dtype."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.histc and not args[0].is_floating_point():
            return func(args[0].float(), *args[1:], **kwargs).to(args[0].dtype)
        return func(*args, **kwargs)


def reference_model(cfg, init, model_overrides=None):
    """torchtitan's model of the job on the CPU, holding the weights `init` (a cpu_state)."""
    from torchtpu.models.moe import use_ragged_experts
    from torchtpu.models.registry import get_family
    from torchtpu.train.model_builder import build_model_args
    from torchtpu.train.tokenizer import build_tokenizer

    args = build_model_args(cfg, build_tokenizer(None).vocab_size)
    if model_overrides:
        args = dataclasses.replace(args, **model_overrides)
    model = use_ragged_experts(get_family(cfg.model.name).torchtitan_model(args))
    params = dict(model.named_parameters())
    assert sorted(params) == sorted(init), (sorted(params), sorted(init))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(init[name])
    return model


class _OneProcess:
    """torchtitan's ParallelDims as a single process sees it: no mesh to reduce the loss (or the
    MoE token counts) over."""

    def get_optional_mesh(self, dims):
        return None


def torchtitan_optimizer(cfg, model):
    """The optimizer torchtitan's TrainSpec for [model] name builds (AdamW, foreach), with its hooks:
    for DeepSeek-V3 and Llama 4 the MoE expert-bias update before each step."""
    import importlib

    from torchtitan.config.job_config import Optimizer as OptimizerConfig

    from torchtpu.models.registry import get_family

    package = get_family(cfg.model.name).model_class.partition(":")[0]
    spec = importlib.import_module(package).get_train_spec()
    o = cfg.optimizer
    config = OptimizerConfig(
        name="AdamW",
        lr=o.lr,
        beta1=o.beta1,
        beta2=o.beta2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        implementation="foreach",
    )
    return spec.build_optimizers_fn([model], config, _OneProcess(), ft_manager=None)


def reference_losses(cfg, init, steps, model_overrides=None):
    """The same job as a plain PyTorch loop on the CPU: same model, weights, batches, optimizer, LR, clipping."""
    return reference_run(cfg, init, steps, model_overrides)[0]


def reference_run(cfg, init, steps, model_overrides=None):
    """(reference_losses, the CPU model after the last step)."""
    from torchtpu.train.data import build_global_batch_loader
    from torchtpu.train.loss import cross_entropy_loss
    from torchtpu.train.lr import build_lr_scheduler
    from torchtpu.train.tokenizer import build_tokenizer

    model = reference_model(cfg, init, model_overrides)
    opt = torchtitan_optimizer(cfg, model)
    ls = cfg.lr_scheduler
    # the schedule drives the container's (one) AdamW, as torchtitan's build_lr_schedulers does
    sched = build_lr_scheduler(
        opt.optimizers[0], ls.warmup_steps, ls.decay_ratio, ls.decay_type, ls.min_lr_factor, cfg.training.steps
    )
    loader = build_global_batch_loader(
        cfg.training.dataset,
        cfg.training.dataset_path,
        build_tokenizer(None),
        cfg.training.seq_len,
        cfg.training.local_batch_size * 8,
        seed=cfg.debug.seed,
    )
    losses = []
    with IntegerHistc():
        for _ in range(steps):
            x, y = next(loader)
            loss = cross_entropy_loss(model(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
    return losses, model
