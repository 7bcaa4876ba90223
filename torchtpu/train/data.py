"""Token batches for the trainer: read documents, tokenize, pack, shard by data-parallel rank.

    loader = build_dataloader("bundled", None, tokenizer, seq_len=2048, local_batch_size=8,
                              dp_rank=0, dp_world_size=1)
    inputs, labels = next(loader)          # numpy int64, shape (local_batch_size, seq_len)
    state = loader.state_dict()            # small dict of ints/strings
    loader.load_state_dict(state)          # continue exactly from there

Sources: torchtpu/train/documents.py (the bundled corpus, local files, Hugging Face streaming).

Packing: each document becomes [BOS] tokens [EOS]; documents are concatenated in order and cut into
consecutive, non-overlapping windows of seq_len + 1 tokens; a window w gives inputs w[:-1] and
labels w[1:]. Documents that are empty or whitespace only are skipped.

The trainer's global batch (build_global_batch_loader): a micro-batch of G sequences is G row
streams, row r being the loader of "rank" r of G below (one sequence per batch). A process builds
only the rows its devices hold, so which rows step k holds, and in which order, never depends on the
number of processes or how the devices are split among them; a checkpoint keeps every row's
position by row index, so a job resumes on another host count or mesh with the same G.

Sharding across data-parallel ranks (or row streams), deterministic and the same on every rank:
  - local files, when there are at least dp_world_size of them: rank r reads files r, r+W, r+2W, ...
    of the sorted list and nothing else;
  - otherwise (one or few files, and the bundled corpus): documents are numbered in reading order
    and rank r keeps document i when i % dp_world_size == r (it still scans the others' text, but
    tokenizes only its own);
  - Hugging Face streaming: datasets.distributed.split_dataset_by_node.

Order and epochs: with infinite=True the source repeats forever; every epoch the bundled corpus's
documents, and local files (as whole files), are put in an order shuffled by (seed, epoch). A
finite loader (infinite=False) makes one pass and drops the last incomplete batch.

Resuming: the state is (epoch, file, document, token offset) of the first token not yet handed out,
plus the shuffle seed, so restoring re-reads from that document (and keeps the saved run's order even
if the new run was given another seed); no token buffer is stored.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .documents import BadRecord, BadRecords, BundledSource, Source, make_source

# --------------------------------------------------------------------------------------------
# The loader
# --------------------------------------------------------------------------------------------


class TokenBatchLoader:
    """Iterator of (inputs, labels) numpy int64 arrays of shape (local_batch_size, seq_len)."""

    def __init__(
        self,
        source: Source,
        tokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        infinite: bool = True,
        bad_records: BadRecords | None = None,
    ):
        if seq_len < 1 or local_batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and local_batch_size ({local_batch_size}) must be positive")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_world_size - 1}")
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        self.bad_records = bad_records if bad_records is not None else BadRecords(0)
        self._bad_before = 0  # bad records this stream skipped before the position it resumed from
        self._bad_at: list[tuple[int, int, int]] = []  # (epoch, unit, doc) of those it skipped since
        self.batches = 0
        self._set_position(0, 0, 0, 0, 0)

    # position = (epoch, unit index, document index in unit, global document index in epoch)
    def _set_position(self, epoch, unit, doc, global_doc, offset):
        self._next_pos = (epoch, unit, doc, global_doc)  # where reading resumes when the buffer empties
        self._skip = offset  # tokens to drop from the first document read
        self._segments: deque = deque()  # [position, tokens, consumed]
        self._docs = self._document_stream(epoch, unit, doc, global_doc)
        self._exhausted = False

    def _owns(self, global_doc: int) -> bool:
        return self.source.shard_by_unit or self.dp_world_size == 1 or global_doc % self.dp_world_size == self.dp_rank

    def _document_stream(self, epoch, unit, doc, global_doc):
        """(position, text) for this rank's documents at or after the position, across epochs."""
        while True:
            units = self.source.units(epoch)
            owned_any = False
            for u in range(unit, len(units)):
                start = doc if u == unit else 0
                last = start - 1
                for index, text in self.source.documents(units[u], start):
                    global_doc += index - last - 1  # documents a reader skipped still count
                    last = index
                    if isinstance(text, BadRecord):  # counted by the one stream that owns it
                        if self._owns(global_doc):
                            self._bad_at.append((epoch, u, index))
                            self.bad_records.skip(text)
                    elif self._owns(global_doc) and text.strip():
                        owned_any = True
                        yield (epoch, u, index, global_doc), text
                    global_doc += 1
            if not self.infinite:
                return
            if not owned_any and unit == 0 and doc == 0:
                raise ValueError(
                    f"data-parallel rank {self.dp_rank} of {self.dp_world_size} got no documents from "
                    f"{self.source.name}; give it more documents or files than ranks"
                )
            epoch, unit, doc, global_doc = epoch + 1, 0, 0, 0

    def _fill(self, need: int) -> bool:
        have = sum(len(t) - c for _, t, c in self._segments)
        while have < need:
            try:
                pos, text = next(self._docs)
            except StopIteration:
                return False
            tokens = np.asarray(self.tokenizer.encode(text, bos=True, eos=True), dtype=np.int64)
            consumed = min(self._skip, len(tokens))
            self._skip = 0
            epoch, unit, doc, global_doc = pos
            self._next_pos = (epoch, unit, doc + 1, global_doc + 1)
            if consumed < len(tokens):
                self._segments.append([pos, tokens, consumed])
                have += len(tokens) - consumed
        return True

    def _take(self, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.int64)
        filled = 0
        while filled < n:
            seg = self._segments[0]
            _, tokens, consumed = seg
            k = min(n - filled, len(tokens) - consumed)
            out[filled : filled + k] = tokens[consumed : consumed + k]
            filled += k
            seg[2] += k
            if seg[2] == len(tokens):
                self._segments.popleft()
        return out

    def __iter__(self):
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        window = self.seq_len + 1
        need = window * self.local_batch_size
        if self._exhausted or not self._fill(need):
            self._exhausted = True
            raise StopIteration
        flat = self._take(need).reshape(self.local_batch_size, window)
        self.batches += 1
        return flat[:, :-1].copy(), flat[:, 1:].copy()

    def state_dict(self) -> dict:
        if self._segments:
            (epoch, unit, doc, global_doc), _, offset = self._segments[0]
        else:
            (epoch, unit, doc, global_doc), offset = self._next_pos, self._skip
        return {
            "source": self.source.name,
            "dp_rank": self.dp_rank,
            "dp_world_size": self.dp_world_size,
            "seed": int(self.source.seed),
            "epoch": int(epoch),
            "file": int(unit),
            "doc": int(doc),
            "global_doc": int(global_doc),
            "offset": int(offset),
            "batches": int(self.batches),
            # read ahead of the position, a bad record is counted again when a resume reads it again
            "bad_records": self._bad_before + sum(p < (epoch, unit, doc) for p in self._bad_at),
        }

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (
            ("source", self.source.name),
            ("dp_world_size", self.dp_world_size),
            ("dp_rank", self.dp_rank),
        ):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"data loader state was saved with {key}={state[key]!r} but this loader has {key}={mine!r}; "
                    f"resume with the same dataset and data-parallel layout (or start the data from scratch)"
                )
        if "seed" in state:  # the shuffle order of the saved run, even if this run drew another seed
            self.source.reseed(int(state["seed"]))
        self._set_position(
            int(state["epoch"]), int(state["file"]), int(state["doc"]), int(state["global_doc"]), int(state["offset"])
        )
        self.batches = int(state.get("batches", 0))
        # the count continues from the checkpoint's (the process's total is the sum over its rows)
        before = int(state.get("bad_records", 0))
        self.bad_records.count += before - self._bad_before - len(self._bad_at)
        self._bad_before, self._bad_at = before, []


def build_dataloader(
    dataset: str,
    dataset_path: str | None,
    tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    seed: int = 0,
    infinite: bool = True,
) -> TokenBatchLoader:
    """This rank's iterator of packed (inputs, labels) batches. See the module docstring."""
    source = make_source(dataset, dataset_path, seed, dp_rank, dp_world_size)
    return TokenBatchLoader(source, tokenizer, seq_len, local_batch_size, dp_rank, dp_world_size, infinite)


class GlobalBatchLoader:
    """Rows `rows` of every micro-batch of `global_rows` sequences: (inputs, labels) of shape
    (len(rows), seq_len), row i being global row rows[i]. Each row is its own stream (see the module
    docstring), so the rows are the same whichever process reads them."""

    def __init__(
        self, make_source, tokenizer, seq_len: int, global_rows: int, rows, infinite: bool = True, max_bad_records=0
    ):
        rows = tuple(sorted(set(int(r) for r in rows)))
        if not rows or rows[0] < 0 or rows[-1] >= global_rows:
            raise ValueError(f"rows {rows} are not a non-empty subset of the {global_rows} rows of the global batch")
        self.global_rows, self.rows, self.seq_len = global_rows, rows, seq_len
        self.local_batch_size = len(rows)
        self.bad_records = BadRecords(max_bad_records)  # shared by this process's rows
        self.streams = [
            TokenBatchLoader(make_source(r), tokenizer, seq_len, 1, r, global_rows, infinite, self.bad_records)
            for r in rows
        ]
        self.source = self.streams[0].source

    def __iter__(self):
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        pairs = [next(s) for s in self.streams]  # a finite stream that runs out ends the whole batch
        return np.concatenate([x for x, _ in pairs]), np.concatenate([y for _, y in pairs])

    def state_dict(self) -> dict:
        """{"global_rows": G, "streams": {row: that row's TokenBatchLoader state}} for this loader's rows."""
        streams = {r: s.state_dict() for r, s in zip(self.rows, self.streams)}
        return {"global_rows": self.global_rows, "streams": streams}

    def load_state_dict(self, state: dict) -> None:
        """Restore this loader's rows from a state holding them ("streams": a {row: state} dict or a
        list indexed by row, as a checkpoint of all rows keeps it)."""
        saved = state.get("global_rows")
        if saved != self.global_rows:
            raise ValueError(
                f"data loader state is for a global batch of {saved} row streams but this loader has "
                f"{self.global_rows}; resume with the same global batch (or start the data from scratch)"
            )
        streams = state["streams"]
        for r, s in zip(self.rows, self.streams):
            s.load_state_dict(streams[r])


def build_global_batch_loader(
    dataset: str,
    dataset_path: str | None,
    tokenizer,
    seq_len: int,
    global_rows: int,
    rows=None,
    seed: int = 0,
    infinite: bool = True,
    max_bad_records: int = 0,
) -> GlobalBatchLoader:
    """Rows `rows` (default: all) of a global batch of `global_rows` row streams. See the module docstring.
    Up to `max_bad_records` malformed records are skipped (`.bad_records.count`), then one is an error."""
    shared = {}

    def row_source(r):
        if "bundled" in shared:  # one copy of the bundled corpus serves every row (it is not rank-dependent)
            return shared["bundled"]
        src = make_source(dataset, dataset_path, seed, r, global_rows)
        if isinstance(src, BundledSource):
            shared["bundled"] = src
        return src

    return GlobalBatchLoader(
        row_source,
        tokenizer,
        seq_len,
        global_rows,
        range(global_rows) if rows is None else rows,
        infinite,
        max_bad_records,
    )


def token_ids_int32(ids, vocab_size: int):
    """Token ids as int32 for the device: TPUs emulate 64-bit integers (docs/DESIGN_NOTES.md).

    Ids index a vocabulary of `vocab_size` < 2**31 entries; an id outside [0, vocab_size) would
    index past the embedding table, so it is refused here, where the host still sees the values.
    """
    import numpy as np

    ids = np.asarray(ids)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"token id {int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())} is outside "
            f"the model's vocabulary [0, {vocab_size}); use the model's own tokenizer"
        )
    return ids.astype(np.int32)
