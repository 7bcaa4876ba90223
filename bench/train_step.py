"""One compiled training step of torchtitan's Llama 3, side by side in one run.

    python -m bench.train_step                 # debugmodel and the ~100M config
    python -m bench.train_step --configs debugmodel --steps 3

For each model config, on one XLA CPU device, it reports tokens/s of:
  (a) torchtpu: torchtitan's Transformer on the tpu device, the whole step (forward, backward,
      clipping, AdamW) compiled by torchtpu.compile into one XLA program;
  (b) pure JAX: the same model and math written directly in JAX (bench/jax_llama.py), the way a
      MaxText user would write it, with the same initial weights, jitted with donated state;
  (c) PyTorch eager on the CPU;
  (d) torch.compile (inductor) on the CPU.
The ratio torchtpu / pure JAX is the cost of the PyTorch frontend (goal: >= 0.95).
"""

from __future__ import annotations

import argparse
import copy
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from torchtitan.models.llama3 import Transformer, TransformerModelArgs, llama3_args  # noqa: E402

import torchtpu  # noqa: E402
from bench import jax_llama  # noqa: E402
from bench.common import lm_step, timed  # noqa: E402

CONFIGS = {
    "debugmodel": (llama3_args["debugmodel"], 4, 128),
    # ~98M parameters from the same model class
    "llama3_100m": (TransformerModelArgs(dim=768, n_layers=12, n_heads=12, vocab_size=8192, rope_theta=500000), 2, 128),
}
LR, BETAS, EPS, WD, MAX_NORM = 8e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


# ----------------------------------------------------------------------------- (b) pure JAX


def jax_params_from(model: Transformer):
    p = {k: jnp.asarray(v.detach().float().numpy()) for k, v in model.state_dict().items() if k != "freqs_cis"}
    return p


def make_jax_loss(args: TransformerModelArgs, seq: int, pin=None):
    """The reference Llama 3 loss (bench/jax_llama.py) as this benchmark runs it: float32, dense
    attention, unrolled layers. `pin(x, kind)` may annotate activations (bench/sharded_step.py)."""
    return jax_llama.make_loss(args, seq, pin=pin)


def make_jax_step(loss_fn):
    return jax.jit(
        jax_llama.adamw_step(loss_fn, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_norm=MAX_NORM),
        donate_argnums=(0, 1, 2, 3),
    )


# ----------------------------------------------------------------------------- torch steps


def torch_step_fn(model, opt):
    return lm_step(model, opt, MAX_NORM)


def bench_config(name, steps, include_inductor):
    args, batch, seq = CONFIGS[name]
    args = copy.deepcopy(args)
    args.max_seq_len = seq
    torch.manual_seed(0)
    base = Transformer(args)
    with torch.no_grad():
        base.init_weights()
    nparams = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    ntok = batch * seq
    results = {}

    # (a) torchtpu
    model = copy.deepcopy(base).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, capturable=True)
    step = torchtpu.compile(torch_step_fn(model, opt))
    xt, yt = x.to("tpu"), y.to("tpu")
    results["torchtpu (compiled step)"] = timed(lambda: step(xt, yt), lambda l: l.item(), warmup=3, steps=steps)
    model = opt = step = None  # free them (the timed closure above still names `step`)

    # (b) pure JAX
    params = jax_params_from(base)
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    state = {"p": params, "m": m, "v": v, "c": jnp.zeros((), jnp.float32)}
    jstep = make_jax_step(make_jax_loss(args, seq))
    xj, yj = jnp.asarray(x.numpy()), jnp.asarray(y.numpy())

    def run_jax():
        state["p"], state["m"], state["v"], state["c"], loss = jstep(
            state["p"],
            state["m"],
            state["v"],
            state["c"],
            xj,
            yj,
        )
        return loss

    results["pure JAX reference"] = timed(run_jax, lambda l: float(l), warmup=2, steps=steps)
    state.clear()  # free the arrays

    # (c) PyTorch eager on CPU
    cpu_model = copy.deepcopy(base)
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    cstep = torch_step_fn(cpu_model, cpu_opt)
    results["PyTorch eager (CPU)"] = timed(lambda: cstep(x, y), lambda l: l.item(), warmup=1, steps=steps)

    # (d) torch.compile / inductor on CPU
    if include_inductor:
        ind_model = copy.deepcopy(base)
        ind_opt = torch.optim.AdamW(ind_model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        istep = torch.compile(torch_step_fn(ind_model, ind_opt))
        results["torch.compile inductor (CPU)"] = timed(lambda: istep(x, y), lambda l: l.item(), warmup=2, steps=steps)

    print(
        f"\n{name}: {nparams / 1e6:.1f}M parameters, batch {batch} x seq {seq} = {ntok} tokens/step, 1 XLA CPU device"
    )
    print(f"{'path':<32}{'s/step':>10}{'tokens/s':>12}")
    for k, t in results.items():
        print(f"{k:<32}{t:>10.3f}{ntok / t:>12.0f}")
    ratio = results["pure JAX reference"] / results["torchtpu (compiled step)"]
    print(f"torchtpu / pure JAX throughput: {ratio:.2f}x")
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-inductor", action="store_true")
    a = ap.parse_args()
    for name in a.configs:
        bench_config(name, a.steps, not a.no_inductor)


if __name__ == "__main__":
    main()
