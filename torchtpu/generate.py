"""Sample from a checkpoint: `python -m torchtpu.generate`.

    python -m torchtpu.generate --config train_configs/debug_model.toml \\
        --checkpoint outputs/debug_model/checkpoint [--prompt "Once upon a time"] \\
        [--max-new-tokens 32] [--temperature 0.8] [--top-k 50] [--seed 0] [--job.xxx overrides]

The model, tokenizer and mesh are the job's ([model], [parallelism] of the config; any trainer
option may follow as an override). --checkpoint is a torchtpu-train checkpoint folder (its newest
step), one step_N folder (full or model-only), or a Hugging Face model folder. With
[model] hf_assets_path empty, a Hugging Face folder's own tokenizer files (a torchtpu-train
export has them) are used; else the bundled tokenizer. The prompt is run through the model once
(prefill), then one token at a time against a KV cache (the family's decode module:
torchtpu.models.llama3.decode); both are `torchtpu.compile` programs, and the decode step is one
program reused for every token (the position is a tensor input). --temperature 0 is greedy.
It prints the prompt, then the continuation (up to the tokenizer's end-of-text token).
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "generate", "load_for_generation", "tokenizer_for"]


def tokenizer_for(cfg, checkpoint: str):
    """The job's tokenizer: [model] hf_assets_path's; when that is empty, the tokenizer files of
    `checkpoint` if it is a Hugging Face folder holding them; else the bundled one."""
    import os

    from torchtpu.train.checkpoint.hf import is_hf_folder
    from torchtpu.train.tokenizer import build_tokenizer

    path = cfg.model.hf_assets_path
    if not path and is_hf_folder(checkpoint):
        if any(os.path.isfile(os.path.join(checkpoint, n)) for n in ("tokenizer.json", "tokenizer.model")):
            path = checkpoint
    return build_tokenizer(path or None)


def load_for_generation(cfg, checkpoint: str, total_len: int):
    """(model, mesh, tokenizer): the job's model laid out on the job's mesh, weights from `checkpoint`."""
    import jax
    import torch

    import torchtpu  # noqa: F401
    from torchtpu.distributed import init_device_mesh, materialize
    from torchtpu.models.registry import FAMILIES, get_family
    from torchtpu.train.config.job_config import ConfigError
    from torchtpu.train.model_builder import build_model_args
    from torchtpu.train.parallel_dims import resolve_dims

    family = get_family(cfg.model.name)
    step = _checkpoint_step(checkpoint)  # a missing checkpoint is an error before the model is built
    if family.decode is None:
        raise ConfigError(
            f"[model] name = {cfg.model.name!r}: torchtpu-generate has no KV-cache decoding for this family; "
            f"families it generates with: {', '.join(n for n, f in FAMILIES.items() if f.decode)}"
        )
    dims = resolve_dims(cfg, len(jax.devices()))
    mesh = init_device_mesh("tpu", dims.mesh_shape, mesh_dim_names=dims.mesh_axis_names)
    tok = tokenizer_for(cfg, checkpoint)
    args = build_model_args(cfg, tok.vocab_size)
    args.max_seq_len = max(args.max_seq_len, total_len)  # the RoPE table must reach every position
    with torch.device("meta"):
        model = family.torchtitan_model(args)
    dtype = getattr(torch, cfg.training.dtype)
    if dtype != torch.float32:
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None and p.is_floating_point():
                    mod._parameters[name] = torch.nn.Parameter(p.to(dtype), requires_grad=False)
    # No sequence parallelism (a decode step has one position) and whole logits (no loss).
    family.parallelize(model, mesh, sequence_parallel=False, loss_parallel=False)
    materialize(model)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("tpu"))  # the RoPE table; weights are overwritten
    model.eval()

    from torchtpu.train.checkpoint.hf import HFCheckpointError, load_hf_into_model

    try:
        if step is None:
            load_hf_into_model(checkpoint, model, args)
        else:
            from torchtpu.train.checkpoint.manager import CheckpointManager, load_model_weights, split_step_path

            ck = CheckpointManager(split_step_path(checkpoint)[0], interval=1, async_mode="sync", read_only=True)
            try:
                load_model_weights(ck, step, model)
            finally:
                ck.close()
    except HFCheckpointError as e:
        raise ConfigError(f"--checkpoint {checkpoint!r}: {e}") from None
    return model, mesh, tok


def _checkpoint_step(checkpoint: str) -> int | None:
    """The step of a torchtpu-train checkpoint that `checkpoint` names (its folder's newest, or the
    step_N folder itself); None for a Hugging Face folder."""
    from torchtpu.train.checkpoint.hf import is_hf_folder
    from torchtpu.train.checkpoint.manager import CheckpointManager, split_step_path
    from torchtpu.train.config.job_config import ConfigError

    if is_hf_folder(checkpoint):
        return None
    folder, step = split_step_path(checkpoint)
    if step is None:
        ck = CheckpointManager(folder, interval=1, async_mode="sync", read_only=True)
        try:
            step = ck.latest_step()
        finally:
            ck.close()
    if step is None:
        raise ConfigError(
            f"--checkpoint {checkpoint!r}: no checkpoint (step_N folder) in it; point it at "
            "a torchtpu-train checkpoint folder, a step_N folder or a Hugging Face folder"
        )
    return step


def generate(
    model, mesh, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0
) -> list[int]:
    """The `max_new_tokens` token ids that follow `prompt_ids` (batch of one)."""
    import torch

    import torchtpu
    from torchtpu.distributed import Replicate, distribute_tensor
    from torchtpu.models.registry import family_of

    decode = importlib.import_module(family_of(model).decode)
    KVCache, forward_cached = decode.KVCache, decode.forward_cached

    def place(t):
        return distribute_tensor(t, mesh, [Replicate()] * mesh.ndim)

    total = len(prompt_ids) + max_new_tokens
    cache = KVCache.empty(model, 1, total, place)

    def pick(logits):
        if temperature == 0:
            return logits.argmax(-1, keepdim=True)
        logits = logits.float() / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        # Gumbel-max: argmax(logits + Gumbel noise) is a sample from softmax(logits)
        u = torch.rand_like(logits).clamp(1e-10, 1.0)
        return (logits - torch.log(-torch.log(u))).argmax(-1, keepdim=True)

    @torch.no_grad()
    def prefill(tokens, start):
        return pick(forward_cached(model, tokens, start, cache)), start + tokens.shape[1]

    @torch.no_grad()
    def step(token, start):
        return pick(forward_cached(model, token, start, cache)), start + 1

    # donate=False: with donated buffers the decode program fails on XLA's CPU client (two state
    # inputs share one buffer, which it reports as donated twice in one call) and crashes when the
    # cache is made on device; so each step writes a new cache buffer.
    prefill_fn, step_fn = torchtpu.compile(prefill, donate=False), torchtpu.compile(step, donate=False)
    token, pos = prefill_fn(place(torch.tensor([prompt_ids], dtype=torch.int64)), place(torch.tensor(0)))
    out = [token]
    for _ in range(max_new_tokens - 1):
        token, pos = step_fn(token, pos)
        out.append(token)
    return [int(x) for x in torch.cat([t.cpu() for t in out], dim=1)[0]]  # one read at the end


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchtpu.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the job's TOML config (model, tokenizer, parallelism)")
    p.add_argument(
        "--checkpoint", required=True, help="torchtpu-train checkpoint (folder or step_N) or Hugging Face folder"
    )
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    a, overrides = p.parse_known_args(argv)
    from torchtpu.train.config.job_config import ConfigError
    from torchtpu.train.config.manager import load_config

    try:
        if a.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {a.max_new_tokens}: must be at least 1")
        if a.temperature < 0:
            raise ConfigError(f"--temperature {a.temperature}: must be >= 0 (0 = greedy)")
        if a.top_k < 0:
            raise ConfigError(f"--top-k {a.top_k}: must be >= 0 (0 = no limit)")
        cfg = load_config(["--config", a.config, *overrides])
        import torch

        import torchtpu  # noqa: F401

        torch.manual_seed(a.seed)
        torch.tpu.manual_seed_all(a.seed)
        tok = tokenizer_for(cfg, a.checkpoint)
        ids = tok.encode(a.prompt, bos=True, eos=False)
        model, mesh, tok = load_for_generation(cfg, a.checkpoint, len(ids) + a.max_new_tokens)
    except ConfigError as e:
        print(f"torchtpu.generate: {e}", file=sys.stderr)
        return 2
    new = generate(model, mesh, ids, a.max_new_tokens, a.temperature, a.top_k)
    if tok.eos_id in new:
        new = new[: new.index(tok.eos_id)]
    print(a.prompt + tok.decode(new), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
