"""The shapes of a compiled step: padding buckets, and one step's inputs packed for one transfer.

A step's program is specialised to its shapes, so the batch is padded:

- tokens to a token bucket (powers of two from `MIN_TOKENS`, the last one
  `max_num_batched_tokens`);
- requests to a request bucket (powers of two from `MIN_REQS`, the last one `max_num_seqs`);
  every scheduled request has a token, so a step never has more requests than tokens.

Each (tokens, requests) pair is one XLA program, compiled once (`Buckets.all()` at warm-up).

A step's integer inputs travel to the device as one int32 array (`pack`), which the program
slices (`unpack`): token ids, positions and cache slots per token; context lengths and query start
offsets per request; the rows whose logits the step returns (one per request, and one per draft
token under speculative decoding); the request count; the block table. Padding tokens have
slot -1 (the cache write skips them) and belong to no request; padding requests have context
length 0 and read logits row 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

MIN_TOKENS = 16
MIN_REQS = 8


def _powers(lo: int, hi: int) -> list[int]:
    out = []
    b = lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(max(hi, lo))
    return out


@dataclasses.dataclass(frozen=True)
class Bucket:
    tokens: int
    reqs: int
    # logits rows the step returns: one per request, or with speculative decoding one per
    # scheduled draft token too, at most min(tokens, reqs x (1 + drafts)); 0 means reqs
    logits: int = 0

    @property
    def logits_rows(self) -> int:
        return self.logits or self.reqs

    def one_row_per_request(self) -> Bucket:
        """The same token and request counts with one logits row per request (a draft model's
        step: the proposer samples one token per request from each forward)."""
        return dataclasses.replace(self, logits=0)


class Buckets:
    """The padding buckets of a runner: token counts x request counts."""

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_seq: int, draft_tokens: int = 0):
        self.token_sizes = _powers(MIN_TOKENS, _round_up(max_tokens, 8))
        self.req_sizes = _powers(MIN_REQS, _round_up(max_reqs, 8))
        self.max_blocks_per_seq = max_blocks_per_seq
        self.draft_tokens = draft_tokens  # speculative tokens per request and step

    def _bucket(self, t: int, r: int) -> Bucket:
        return Bucket(t, r, min(t, r * (1 + self.draft_tokens)) if self.draft_tokens else 0)

    def for_batch(self, num_tokens: int, num_reqs: int) -> Bucket:
        t = next((b for b in self.token_sizes if b >= num_tokens), None)
        r = next((b for b in self.req_sizes if b >= num_reqs), None)
        if t is None or r is None:
            raise ValueError(
                f"torchtpu: a step of {num_tokens} tokens and {num_reqs} requests is larger than the largest "
                f"bucket ({self.token_sizes[-1]} tokens, {self.req_sizes[-1]} requests): "
                "max_num_batched_tokens/max_num_seqs changed after start-up"
            )
        return self._bucket(t, r)

    def all(self) -> list[Bucket]:
        """Every bucket a batch can fall in: a request bucket r serves token bucket t when some
        request count above the previous request bucket fits in t tokens."""
        prev = [0] + self.req_sizes[:-1]
        return [self._bucket(t, r) for t in self.token_sizes for r, p in zip(self.req_sizes, prev) if p < t]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def layout(bucket: Bucket, max_blocks_per_seq: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Where each input lies in the packed array: name -> (offset, shape)."""
    t, r = bucket.tokens, bucket.reqs
    fields = [
        ("input_ids", (t,)),
        ("positions", (t,)),
        ("slot_mapping", (t,)),
        ("kv_lens", (r,)),
        ("cu_q_lens", (r + 1,)),
        ("num_seqs", (1,)),
        ("logits_indices", (bucket.logits_rows,)),
        ("block_tables", (r, max_blocks_per_seq)),
    ]
    out, off = {}, 0
    for name, shape in fields:
        out[name] = (off, shape)
        off += int(np.prod(shape))
    out["_size"] = (off, ())
    return out


def pack(
    bucket: Bucket,
    max_blocks_per_seq: int,
    *,
    input_ids,
    positions,
    slot_mapping,
    seq_lens,
    query_start_loc,
    block_table,
    logits_indices,
) -> np.ndarray:
    """The step's inputs as one int32 host array (see the module docstring)."""
    lay = layout(bucket, max_blocks_per_seq)
    buf = np.zeros(lay["_size"][0], np.int32)

    def put(name, values, fill=0):
        off, shape = lay[name]
        n = int(np.prod(shape))
        view = buf[off : off + n].reshape(shape)
        if fill:
            view[...] = fill
        v = np.asarray(values, dtype=np.int32)
        view[tuple(slice(0, s) for s in v.shape)] = v

    n_req = len(seq_lens)
    put("input_ids", input_ids)
    put("positions", positions)
    put("slot_mapping", slot_mapping, fill=-1)
    put("kv_lens", seq_lens)
    off, _ = lay["cu_q_lens"]
    q = np.asarray(query_start_loc, np.int32)
    buf[off : off + len(q)] = q
    buf[off + len(q) : off + bucket.reqs + 1] = q[-1]
    put("num_seqs", [n_req])
    put("logits_indices", logits_indices)
    width = min(block_table.shape[1], max_blocks_per_seq)
    put("block_tables", np.asarray(block_table)[:, :width])
    return buf


def unpack(packed: torch.Tensor, bucket: Bucket, max_blocks_per_seq: int) -> dict[str, torch.Tensor]:
    """Slice the packed tensor (on tpu, inside the step) back into its inputs."""
    out = {}
    for name, (off, shape) in layout(bucket, max_blocks_per_seq).items():
        if name == "_size":
            continue
        out[name] = packed.narrow(0, off, int(np.prod(shape))).view(shape)
    return out


def empty(bucket: Bucket, max_blocks_per_seq: int) -> np.ndarray:
    """The packed inputs of a step of padding only: no request, every slot -1, so it writes nothing
    (what warm-up runs)."""
    return pack(
        bucket,
        max_blocks_per_seq,
        input_ids=np.zeros(0, np.int32),
        positions=np.zeros(0, np.int32),
        slot_mapping=np.zeros(0, np.int32),
        seq_lens=np.zeros(0, np.int32),
        query_start_loc=np.zeros(1, np.int32),
        block_table=np.zeros((0, max_blocks_per_seq), np.int32),
        logits_indices=np.zeros(0, np.int32),
    )
