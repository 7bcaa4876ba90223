"""Step time of four training loops in each eager mode, against torchtpu.compile.

    python -m bench.eager_modes [--steps N]

The loops are PyTorch's own tutorials as users write them, each reading `loss.item()` every
step: the quickstart MLP (784-512-512-10, SGD, batch 64), the CIFAR-10 CNN (SGD with
momentum, batch 32), a 2-layer `nn.TransformerEncoder` language model (AdamW, 8 x 64
tokens) and a `transformers` Llama fine-tuned as a causal LM (a tiny random LlamaConfig: 2 layers,
width 64; AdamW, 8 x 64 tokens). Each loop runs under strict eager, fused eager and `torchtpu.compile` (the same step
function compiled whole) in this one process, from the same initial weights. Reports the
median step time after 5 warm-up steps, wall clock and the process's CPU time (all threads:
steadier than the wall clock when other jobs share the cores), each against compiled, the XLA
programs compiled during the timed steps (0 when a loop has settled) and each mode's last loss.

    python -m bench.eager_modes --split

compares, in fused mode, a read's flush run as two programs (the ops the read needs first, the
rest after without waiting for them: the default) with one program, the two alternating.

    python -m bench.eager_modes --cold

times the first three steps of each loop and mode, each in a fresh process with the persistent
compilation cache off: what a mode costs before it settles (tracing and compiling), and the XLA
programs each step compiles.

    python -m bench.eager_modes --memory

an inference loop that reads nothing until the end (100 batches of 64 x 3 x 128 x 128 through a
small CNN, each batch moved to the device and dropped): the process's peak RSS in strict mode, in
fused mode, and in fused mode without its bound on dropped inputs a graph holds, each in a fresh
process, with glibc's malloc as it comes and with its mmap threshold fixed at 1 MiB (which returns
each freed batch to the system, so the figure is what the process holds rather than its heap's
fragmentation); the same loop over 400 batches on PyTorch's CPU, in strict mode with and without
torchtpu's heap trimming (backend.heap) and in fused mode; then the temporaries XLA gives one program of 1, 5 and 10 such batches (the CNN's
convolution, ReLU and mean written in JAX) on XLA:CPU, on XLA:CPU without its concurrency-optimized
scheduler, and compiled ahead of time for a TPU v5e.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import torchtpu  # noqa: E402


class Quickstart(nn.Module):
    """The PyTorch quickstart tutorial's network (FashionMNIST, 28 x 28 images, 10 classes)."""

    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(28 * 28, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )

    def forward(self, x):
        return self.linear_relu_stack(self.flatten(x))


class CifarNet(nn.Module):
    """The CIFAR-10 tutorial's CNN (32 x 32 RGB images, 10 classes)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class EncoderLM(nn.Module):
    """A causal language model on `nn.TransformerEncoder` (2 layers), as in PyTorch's
    language-modeling tutorial."""

    def __init__(self, vocab=256, dim=64, heads=4, dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))


def make_loop(name: str, *, batch: int | None = None, seq: int = 64, dropout: float = 0.0, seed: int = 0):
    """(model, optimizer factory, loss function, batches) of the loop `name` on the CPU; batches
    is a list of (inputs, targets) pairs, one per step, cycled."""
    g = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)
    if name == "quickstart":
        model, n = Quickstart(), batch or 64
        batches = [(torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)) for _ in range(4)]
        return model, lambda p: torch.optim.SGD(p, lr=1e-3), nn.CrossEntropyLoss(), batches
    if name == "cifar":
        model, n = CifarNet(), batch or 32
        batches = [(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)) for _ in range(4)]
        return model, lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9), nn.CrossEntropyLoss(), batches
    if name == "encoder":
        model, n = EncoderLM(dropout=dropout), batch or 8
        batches = []
        for _ in range(4):
            tokens = torch.randint(0, 256, (n, seq + 1), generator=g)
            batches.append((tokens[:, :-1], tokens[:, 1:]))

        def lm_loss(logits, targets):
            return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

        return model, lambda p: torch.optim.AdamW(p, lr=1e-3), lm_loss, batches
    if name == "llama":
        model, n = _tiny_llama(), batch or 8
        tokens = [torch.randint(0, LLAMA_VOCAB, (n, seq), generator=g) for _ in range(4)]

        def causal_lm_loss(out, labels):  # the model's own loss (the labels shifted inside)
            return model.loss_function(out.logits, labels, vocab_size=LLAMA_VOCAB)

        return model, lambda p: torch.optim.AdamW(p, lr=1e-3), causal_lm_loss, [(t, t) for t in tokens]
    raise ValueError(f"unknown loop {name!r}: {', '.join(LOOPS)}")


LOOPS = ("quickstart", "cifar", "encoder", "llama")
LLAMA_VOCAB = 256


def _tiny_llama():
    """A `transformers` Llama with random weights: 2 layers, width 64, grouped-query attention
    (4 query heads share 2 key/value heads), SDPA attention, fine-tuned as a causal LM."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=LLAMA_VOCAB,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def train_step(model, opt, loss_fn):
    """The tutorials' step: zero the gradients, forward, loss, backward, optimizer step."""

    def step(inputs, targets):
        opt.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        opt.step()
        return loss

    return step


def on_device(name: str, device: str, **kwargs):
    """The loop `name` with its model, optimizer and batches on `device`: (step, batches)."""
    model, make_opt, loss_fn, batches = make_loop(name, **kwargs)
    model = model.to(device)
    opt = make_opt(model.parameters())
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    return train_step(model, opt, loss_fn), batches


def _bench_mode(name, mode, steps):
    from torchtpu._platform import XLA_COMPILES

    with torchtpu.eager_mode("fused" if mode == "fused" else "strict"):
        step, batches = on_device(name, "tpu")
        if mode == "compiled":
            step = torchtpu.compile(step)
        i = [0]
        losses = []

        def run():
            x, y = batches[i[0] % len(batches)]
            i[0] += 1
            loss = step(x, y).item()
            losses.append(loss)
            return loss

        for _ in range(5):
            run()
        compiles = XLA_COMPILES[0]
        wall, cpu = [], []
        for _ in range(steps):
            w, c = time.perf_counter(), time.process_time()
            run()
            wall.append(time.perf_counter() - w)
            cpu.append(time.process_time() - c)
        return statistics.median(wall), statistics.median(cpu), XLA_COMPILES[0] - compiles, losses[-1]


def _fused_split_ab(name, steps, rounds=3):
    """Fused step times of loop `name` with a read's flush run as two programs (the ops the read
    needs, then the rest, which the read does not wait for: backend.fused._plan) and as one, the two
    alternating in rounds in this process: {variant: [(wall ms, CPU ms) per round]}."""
    from torchtpu.backend import fused

    split_min_rest = fused.SPLIT_MIN_REST
    out: dict = {"two programs": [], "one program": []}
    try:
        with torchtpu.eager_mode("fused"):
            loops = {v: on_device(name, "tpu") for v in out}
            for _ in range(rounds):
                for variant, (step, batches) in loops.items():
                    fused.SPLIT_MIN_REST = split_min_rest if variant == "two programs" else 1 << 62
                    fused._PROGRAMS.clear()  # each variant builds (and caches) its own programs
                    for i in range(5):
                        step(*batches[i % len(batches)]).item()
                    wall, cpu = [], []
                    for i in range(steps):
                        w, c = time.perf_counter(), time.process_time()
                        step(*batches[i % len(batches)]).item()
                        wall.append(time.perf_counter() - w)
                        cpu.append(time.process_time() - c)
                    out[variant].append((statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3))
    finally:
        fused.SPLIT_MIN_REST = split_min_rest
    return out


def _cold(name, mode):
    """Wall seconds and XLA compiles of the first 3 steps of loop `name` in `mode`, in this
    (fresh) process."""
    from torchtpu._platform import XLA_COMPILES

    out = []
    with torchtpu.eager_mode("fused" if mode == "fused" else "strict"):
        step, batches = on_device(name, "tpu")
        if mode == "compiled":
            step = torchtpu.compile(step)
        for i in range(3):
            c, w = XLA_COMPILES[0], time.perf_counter()
            step(*batches[i % len(batches)]).item()
            out.append((time.perf_counter() - w, XLA_COMPILES[0] - c))
    return out


def _in_fresh_process(fn, *args, **env):
    """`fn(*args)` (a function of this module returning JSON-able data) run in a new Python process
    with `env` added to this one's environment: its return value."""
    import json
    import subprocess
    import sys

    code = f"import json, bench.eager_modes as b; print(json.dumps(b.{fn.__name__}(*{args!r})))"
    res = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True, check=True
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def _cold_all():
    print("first three steps, each loop and mode in a fresh process, no persistent cache: wall s (XLA compiles)")
    for name in LOOPS:
        for mode in ("strict", "fused", "compiled"):
            steps = _in_fresh_process(_cold, name, mode, TORCHTPU_CACHE_DIR="off")
            print(f"{name:<12}{mode:<10}" + "".join(f"{w:8.2f} ({c:3d})" for w, c in steps))


def _inference_peak_rss(mode, batches=100, device="tpu"):
    """Peak RSS (MB) of this (fresh) process after an inference loop that reads nothing until the
    end, in eager `mode` (with `device="cpu"`, PyTorch's own loop on the CPU)."""
    import contextlib
    import resource

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    with torchtpu.eager_mode(mode) if device == "tpu" else contextlib.nullcontext():
        model = model.to(device)
        preds = []
        with torch.no_grad():
            for _ in range(batches):
                preds.append(model(torch.randn(64, 3, 128, 128).to(device)).argmax(-1))
        torch.stack(preds).cpu()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _batch_program_temporaries(batches, topology=None):
    """MB of temporaries XLA assigns one program that runs the inference CNN's convolution, ReLU and
    mean on `batches` batches at once, compiled for this process's CPU or ahead of time for a TPU
    `topology`."""
    import jax
    import jax.numpy as jnp

    def chain(x, w):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return jnp.maximum(y, 0).mean(axis=(2, 3))

    sharding = None
    if topology is not None:
        from jax.sharding import NamedSharding, PartitionSpec

        from torchtpu.distributed.topology import topology_devices, topology_mesh

        mesh = topology_mesh(topology, (len(topology_devices(topology)),), ("x",))
        sharding = NamedSharding(mesh, PartitionSpec())
    w = jax.ShapeDtypeStruct((8, 3, 3, 3), jnp.float32, sharding=sharding)
    xs = [jax.ShapeDtypeStruct((64, 3, 128, 128), jnp.float32, sharding=sharding)] * batches
    compiled = jax.jit(lambda w, *xs: [chain(x, w) for x in xs]).lower(w, *xs).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def _memory_all():
    print("inference loop, 100 batches of 12.6 MB dropped after use, nothing read until the end: peak RSS MB")
    print(f"{'':<34}{'malloc':>8}{'mmap 1 MiB':>12}  (glibc's default; its mmap threshold fixed at 1 MiB)")
    fixed = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}  # large buffers unmapped when freed: no heap growth
    for label, mode, env in (
        ("strict", "strict", {}),
        ("fused", "fused", {}),
        ("fused, no bound on held inputs", "fused", {"TORCHTPU_FUSED_MAX_HELD_MB": "1e9"}),
    ):
        default = _in_fresh_process(_inference_peak_rss, mode, **env)
        print(f"{label:<34}{default:8.0f}{_in_fresh_process(_inference_peak_rss, mode, **env, **fixed):12.0f}")
    print("the same loop, 400 batches: peak RSS MB")
    for label, mode, device, env in (
        ("PyTorch on the CPU", "strict", "cpu", {}),
        ("strict", "strict", "tpu", {}),
        ("strict, heap not trimmed", "strict", "tpu", {"TORCHTPU_MALLOC_TRIM": "0"}),
        ("fused", "fused", "tpu", {}),
    ):
        print(f"{label:<34}{_in_fresh_process(_inference_peak_rss, mode, 400, device, **env):8.0f}")
    print(
        "temporaries of one program of n batches (convolution, ReLU, mean), MB: n, XLA:CPU, XLA:CPU without its "
        "concurrency-optimized scheduler, TPU v5e (AOT)"
    )
    serial = {"XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " " + SERIAL_SCHEDULER).strip()}
    for n in (1, 5, 10):
        cpu, cpu_serial = _batch_program_temporaries(n), _in_fresh_process(_batch_program_temporaries, n, **serial)
        print(f"{n:>3}{cpu:9.0f}{cpu_serial:9.0f}{_batch_program_temporaries(n, 'v5e:2x2'):9.0f}")


# XLA:CPU's scheduler that runs independent ops at once, at the cost of keeping their buffers live
SERIAL_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--split",
        action="store_true",
        help="compare fused mode's two programs per read (the read's ops first) with one, alternating",
    )
    parser.add_argument("--cold", action="store_true", help="the first steps of each mode, in fresh processes")
    parser.add_argument("--memory", action="store_true", help="peak RSS of an inference loop that reads nothing")
    args = parser.parse_args()
    if args.memory:
        _memory_all()
        return
    if args.cold:
        _cold_all()
        return
    if args.split:
        print(f"fused eager, median of {args.steps} steps after warm-up per round, wall ms / CPU ms")
        for name in LOOPS:
            for variant, rounds in _fused_split_ab(name, args.steps).items():
                print(f"{name:<12}{variant:<14}" + "  ".join(f"{w:7.2f} / {c:6.2f}" for w, c in rounds))
        return
    print(f"platform {torchtpu.platform()}, median of {args.steps} steps after warm-up, loss.item() every step")
    print(
        f"{'loop':<12}{'mode':<10}{'ms/step':>10}{'/ compiled':>12}{'CPU ms':>10}{'/ compiled':>12}{'compiles':>10}"
        "  last loss"
    )
    for name in LOOPS:
        results = {mode: _bench_mode(name, mode, args.steps) for mode in ("strict", "fused", "compiled")}
        wall0, cpu0 = results["compiled"][:2]
        for mode, (wall, cpu, compiles, loss) in results.items():
            print(
                f"{name:<12}{mode:<10}{wall * 1e3:>10.2f}{wall / wall0:>11.2f}x{cpu * 1e3:>10.2f}{cpu / cpu0:>11.2f}x"
                f"{compiles:>10}  {loss:.6f}"
            )


if __name__ == "__main__":
    main()
