"""Training metrics: model FLOPs per token, per-chip peak FLOP/s (for MFU), and the metrics logger.

flops = model_flops_per_token(model, model_args, seq_len)[1]
peak, where = peak_flops()              # (459e12, "table: TPU v5p") on a v5p chip
step = step_metrics(seconds_per_step, tokens_per_step, devices, flops, peak)   # MFU: costing.mfu_percent

logger = MetricsLogger("outputs/run1", log_freq=10, enable_tensorboard=True, enable_wandb=False,
                       total_steps=1000, is_main_process=(jax.process_index() == 0))
logger.log(step, {"loss": 3.2, "grad_norm": 0.9, "lr": 3e-4, "tps": 12000, "tflops": 80.1,
                  "mfu": 41.2, "step_time": 0.51, "memory_gib": 60.2})
logger.close()
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import sys
import time

# --------------------------------------------------------------------------------------------
# FLOPs per token: the counts live with the model families (torchtpu.models.flops). Imported when
# called, so this module loads on its own (the W&B test runs it without the package).
# --------------------------------------------------------------------------------------------


def num_flops_per_token(num_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> int:
    """torchtpu.models.flops.num_flops_per_token: 6 N + 12 L H Q T."""
    from ..models import flops

    return flops.num_flops_per_token(num_params, n_layers, n_heads, head_dim, seq_len)


def non_embedding_params(model) -> tuple[int, int]:
    """torchtpu.models.flops.non_embedding_params."""
    from ..models import flops

    return flops.non_embedding_params(model)


def model_flops_per_token(model, model_args, seq_len: int) -> tuple[int, int]:
    """torchtpu.models.flops.model_flops_per_token: (parameters, FLOPs per token) of a dense decoder."""
    from ..models import flops

    return flops.model_flops_per_token(model, model_args, seq_len)


# --------------------------------------------------------------------------------------------
# Peak FLOP/s per chip
# --------------------------------------------------------------------------------------------

_MEMO: dict[str, tuple[float, str]] = {}


def peak_flops_cache_file() -> str | None:
    """Where measured peaks are kept: $TORCHTPU_CACHE_DIR/peak_flops.json, by default
    ~/.cache/torchtpu/peak_flops.json (None when TORCHTPU_CACHE_DIR=off)."""
    from torchtpu import cache_root

    root = cache_root()
    return None if root is None else os.path.join(root, "peak_flops.json")


def _read_cache(path: str | None) -> dict:
    if not path or not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _find_device(device_kind: str | None):
    import jax

    from torchtpu.hardware import CHIPS

    if device_kind is None:
        return jax.devices()[0]
    candidates = []
    for backend in ("tpu", "gpu", "cpu"):
        try:
            candidates += jax.devices(backend)
        except RuntimeError:
            pass
    for dev in jax.devices() + candidates:
        if dev.device_kind == device_kind or dev.platform == device_kind.lower():
            return dev
    raise ValueError(
        f"no peak FLOP/s known for device kind {device_kind!r}: it is not a TPU in the table "
        f"({', '.join(f'TPU {c}' for c in CHIPS)}) and no local JAX device of that kind exists to measure"
    )


def measure_peak_flops(device=None, size: int | None = None, repeats: int | None = None) -> tuple[float, str]:
    """Time a chain of square matmuls in one jitted program on `device`; best FLOP/s over a few runs.

    bfloat16 on GPU/TPU; float32 on CPU (XLA's CPU matmuls have no native bfloat16 path, so a
    bf16 figure there would measure conversion, not the machine's peak)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    dev = device or jax.devices()[0]
    on_cpu = dev.platform == "cpu"
    dtype = jnp.float32 if on_cpu else jnp.bfloat16
    n = size or (1024 if on_cpu else 8192)
    chain = repeats or (4 if on_cpu else 20)
    rng = np.random.default_rng(0)
    a = jax.device_put(jnp.asarray(rng.standard_normal((n, n), dtype=np.float32), dtype=dtype), dev)
    b = jax.device_put(jnp.asarray(rng.standard_normal((n, n), dtype=np.float32) / math.sqrt(n), dtype=dtype), dev)

    @jax.jit
    def run(x, y):
        return jax.lax.fori_loop(0, chain, lambda i, c: jnp.dot(c, y, preferred_element_type=dtype), x)

    run(a, b).block_until_ready()  # compile and warm up
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        run(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 * chain / best, jnp.dtype(dtype).name


def peak_flops(device_kind: str | None = None) -> tuple[float, str]:
    """(peak FLOP/s of one chip, where the figure comes from).

    TPUs: the chip table's bf16 peak (`torchtpu.hardware.CHIPS`: v4 275, v5e 197, v5p 459, v6e 918 TFLOP/s), keyed by jax's
    `device.device_kind` ("TPU v4", "TPU v5 lite", "TPU v5", "TPU v5p", "TPU v6 lite", ...).
    Anything else (CPU, GPU, an unknown TPU): measured once by `measure_peak_flops` on a local device
    of that kind and kept in `peak_flops_cache_file()`, so later runs reuse it. `device_kind=None`
    means jax's first device.
    """
    if device_kind is None:
        import jax

        device_kind = jax.devices()[0].device_kind
    from torchtpu.hardware import chip_of

    chip = chip_of(device_kind)
    if chip is not None:
        return chip.peak_bf16_flops, f"table: TPU {chip.name}"
    dev = _find_device(device_kind)
    key = f"{dev.platform}:{dev.device_kind}"
    label = dev.platform if dev.device_kind.lower() == dev.platform else f"{dev.platform} ({dev.device_kind})"
    if key in _MEMO:
        return _MEMO[key]
    path = peak_flops_cache_file()
    entry = _read_cache(path).get(key)
    if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0:
        result = float(entry["flops"]), f"measured once on {label} ({entry.get('dtype', '?')} matmul), cached at {path}"
        _MEMO[key] = result
        return result
    flops, dtype = measure_peak_flops(dev)
    if path:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            data = _read_cache(path)
            data[key] = {
                "flops": flops,
                "dtype": dtype,
                "measured": datetime.datetime.now().isoformat(timespec="seconds"),
            }
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
            where = f"measured once on {label} ({dtype} matmul), cached at {path}"
        except OSError:
            where = f"measured on {label} ({dtype} matmul), not cached ({path} is not writable)"
    else:
        where = f"measured on {label} ({dtype} matmul), not cached (TORCHTPU_CACHE_DIR=off)"
    _MEMO[key] = (flops, where)
    return flops, where


# --------------------------------------------------------------------------------------------
# The logger
# --------------------------------------------------------------------------------------------

# Console fields in order: (metric key(s), label, format).
_CONSOLE = (
    (("loss",), "loss", "{:.4f}"),
    (("grad_norm",), "grad_norm", "{:.4f}"),
    (("lr",), "lr", "{:.3e}"),
    (("tps",), "tps", "{:,.0f}"),
    (("tflops",), "tflops", "{:.2f}"),
    (("mfu",), "mfu", "{:.2f}%"),
    (("step_time", "time_s", "step_time_s"), "step", "{:.3f}s"),
    (("memory_gib", "memory", "mem_gib"), "mem", "{:.2f}GiB"),
    (("moe/max_over_mean",), "moe max/mean", "{:.2f}"),
)
# metrics.jsonl, TensorBoard and W&B only: the console line shows the one item above for them
_FILE_ONLY_PREFIXES = ("moe/",)


def _plain(value):
    """A JSON/TensorBoard-friendly Python value (numpy, jax and torch scalars become floats/ints)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):
        try:
            return value.item()
        except (TypeError, ValueError, RuntimeError):
            pass
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _wandb_reachable(timeout: float = 3.0) -> bool:
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    name, _, port = host.partition(":")
    try:
        socket.create_connection((name, int(port or 443)), timeout=timeout).close()
        return True
    except OSError:
        return False


_COLORS = {"step": "\033[33m", "loss": "\033[32m", "validation": "\033[35m", "reset": "\033[39m"}


class MetricsLogger:
    """Writes each logged step to <dump_folder>/metrics.jsonl, one console line, and optionally
    TensorBoard (<dump_folder>/<tb_folder>) and Weights & Biases (run files under <dump_folder>/wandb;
    offline when WANDB_API_KEY is unset or the W&B server is unreachable). Only the main process
    writes anything; on other processes every method is a no-op, unless `rank` is given (metrics
    from every host): then host `rank` > 0 writes metrics_rank_<rank>.jsonl and <tb_folder>/rank_<rank>
    (rank 0 writes <tb_folder>/rank_0) and prints nothing. With `total_steps` and a terminal on
    stdout, a progress bar with ETA sits under the lines. `color`: ANSI colours on the console."""

    def __init__(
        self,
        dump_folder: str,
        log_freq: int,
        enable_tensorboard: bool,
        enable_wandb: bool,
        wandb_project: str | None = None,
        run_name: str | None = None,
        config_dict: dict | None = None,
        is_main_process: bool = True,
        total_steps: int | None = None,
        tb_folder: str = "tb",
        color: bool = False,
        rank: int | None = None,
        start_step: int = 0,
    ):
        self.dump_folder = os.path.abspath(dump_folder)
        self.run_name = run_name
        self.log_freq = max(1, int(log_freq))
        self.total_steps = total_steps
        self.enabled = bool(is_main_process) or rank is not None
        self.console = bool(is_main_process)
        self.color = bool(color)
        suffix = f"_rank_{rank}" if rank else ""
        self.jsonl_path = os.path.join(self.dump_folder, f"metrics{suffix}.jsonl")
        self.tb_dir = os.path.join(self.dump_folder, tb_folder, *([f"rank_{rank}"] if rank is not None else []))
        self.wandb_mode = None
        self._file = self._tb = self._wandb = self._bar = None
        self._first: tuple[int, float] | None = None  # (step, time) of the first line logged: the ETA's base
        if not self.enabled:
            return
        os.makedirs(self.dump_folder, exist_ok=True)
        self._file = open(self.jsonl_path, "a", encoding="utf-8")
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=self.tb_dir)
        if enable_wandb:
            self._start_wandb(wandb_project, run_name, config_dict)
        if total_steps and self.console and sys.stdout.isatty():
            from tqdm import tqdm

            # a resumed run's bar starts at its step, and its rate counts only the steps run here
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, leave=True)

    def _start_wandb(self, project, run_name, config_dict):
        import wandb

        mode = os.environ.get("WANDB_MODE")
        if not mode:
            mode = "online" if os.environ.get("WANDB_API_KEY") and _wandb_reachable() else "offline"
        self.wandb_mode = mode
        self._wandb = wandb.init(
            project=project or "torchtpu",
            name=run_name,
            config=config_dict or {},
            dir=self.dump_folder,
            mode=mode,
            reinit="finish_previous",
        )

    def should_log(self, step: int) -> bool:
        """Whether `step` (1-based) is a logging step: the first, every log_freq-th, and the last."""
        return step == 1 or step % self.log_freq == 0 or (self.total_steps is not None and step == self.total_steps)

    def eta_seconds(self, step: int, metrics: dict, now: float) -> float | None:
        """Seconds left until total_steps: the average step since the first line logged, or at that
        first line its own step time (None without total_steps or a time to go by)."""
        if not self.total_steps:
            return None
        left = self.total_steps - int(step)
        if self._first is not None and step > self._first[0]:
            return left * (now - self._first[1]) / (step - self._first[0])
        step_time = metrics.get("step_time")
        return left * float(step_time) if isinstance(step_time, (int, float)) else None

    def format_line(self, step: int, metrics: dict, eta: float | None = None) -> str:
        """`step n/N | eta H:MM:SS | loss ... | ...` (n/N and the ETA when total_steps is known)."""
        width = len(str(self.total_steps)) if self.total_steps else 0
        parts = [f"step {step:>{width}d}/{self.total_steps}" if width else f"step {step}"]
        if eta is not None:
            parts.append(f"eta {datetime.timedelta(seconds=round(eta))}")
        used = set()
        for keys, label, fmt in _CONSOLE:
            for key in keys:
                if key in metrics and metrics[key] is not None:
                    value = _plain(metrics[key])
                    try:
                        parts.append(f"{label} {fmt.format(value)}")
                    except (TypeError, ValueError):
                        parts.append(f"{label} {value}")
                    used.add(key)
                    break
        for key, value in metrics.items():
            if key not in used and key != "step" and value is not None and not key.startswith(_FILE_ONLY_PREFIXES):
                value = _plain(value)
                parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
        if self.color:
            c = _COLORS
            parts = [
                c["step"] + p + c["reset"]
                if p.startswith("step ")
                else c["loss"] + p + c["reset"]
                if p.startswith("loss ")
                else c["validation"] + p + c["reset"]
                if p.startswith("validation/")
                else p
                for p in parts
            ]
        return " | ".join(parts)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": int(step)}
        record.update({k: _plain(v) for k, v in metrics.items() if k != "step"})
        record["time"] = round(time.time(), 3)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        now = time.monotonic()
        line = self.format_line(step, metrics, self.eta_seconds(step, metrics, now))
        if self._first is None:
            self._first = (int(step), now)
        if self._bar is not None:
            self._bar.write(line)
            self._bar.n = min(int(step), self._bar.total)
            self._bar.refresh()
        elif self.console:
            print(line, flush=True)
        numeric = {
            k: v
            for k, v in record.items()
            if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=int(step))

    def progress(self, step: int) -> None:
        """Move the progress bar (if any) to `step` without logging."""
        if self._bar is not None:
            self._bar.n = min(int(step), self._bar.total)
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def build_metrics_logger(
    cfg, process_index: int, total_steps: int, stdout_is_terminal: bool | None = None, start_step: int = 0
):
    """The MetricsLogger a torchtpu-train job configured by `cfg` ([metrics], [job]) uses on host
    `process_index`; `start_step`: the step a resumed run continues from."""
    m = cfg.metrics
    tty = sys.stdout.isatty() if stdout_is_terminal is None else stdout_is_terminal
    return MetricsLogger(
        cfg.job.dump_folder,
        m.log_freq,
        m.enable_tensorboard,
        m.enable_wandb,
        run_name=cfg.job.description,
        config_dict=cfg.to_dict(),
        is_main_process=process_index == 0,
        total_steps=total_steps,
        tb_folder=m.save_tb_folder,
        color=tty and not m.disable_color_printing,
        rank=process_index if m.save_for_all_ranks else None,
        start_step=start_step,
    )


# --------------------------------------------------------------------------------------------
# A logged step's throughput
# --------------------------------------------------------------------------------------------


class StepTimer:
    """Wall seconds per training step since the last logged step, with evaluation time left out."""

    def __init__(self):
        self.restart()

    def restart(self) -> None:
        self._t0 = time.perf_counter()
        self._steps = 0

    def step_done(self) -> None:
        self._steps += 1

    def leave_out(self, seconds: float) -> None:
        """Time spent on something other than training steps (a validation) since the last restart."""
        self._t0 += seconds

    def seconds_per_step(self) -> float:
        return (time.perf_counter() - self._t0) / self._steps


def step_metrics(
    seconds_per_step: float, tokens_per_step: int, devices: int, flops_per_token: float, peak: float
) -> dict[str, float]:
    """Tokens/s per device ("tps"), model TFLOP/s per device ("tflops"), MFU in % of `peak` FLOP/s per
    device ("mfu") and the step time ("step_time") of steps of `tokens_per_step` tokens over `devices`
    devices that took `seconds_per_step` each."""
    tps = tokens_per_step / seconds_per_step / devices
    tflops = flops_per_token * tps / 1e12
    from torchtpu.costing import mfu_percent

    mfu = mfu_percent(flops_per_token * tokens_per_step, seconds_per_step, devices, peak)
    return {"tps": tps, "tflops": tflops, "mfu": mfu, "step_time": seconds_per_step}


def device_memory_gib() -> float | None:
    """Device memory in use on this process's first device (GiB)."""
    import jax

    from torchtpu.backend import device_memory_stats

    return device_memory_stats(jax.local_devices()[0]).get("bytes_in_use", 0) / 1024**3
