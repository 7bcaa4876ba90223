"""Token batches for the trainer: read documents, tokenize, pack, shard by data-parallel rank.

    loader = build_dataloader("bundled", None, tokenizer, seq_len=2048, local_batch_size=8,
                              dp_rank=0, dp_world_size=1)
    inputs, labels = next(loader)          # numpy int64, shape (local_batch_size, seq_len)
    state = loader.state_dict()            # small dict of ints/strings
    loader.load_state_dict(state)          # continue exactly from there

Sources
  - dataset="bundled" (dataset_path empty): the corpus shipped in torchtpu/train/assets/corpus.txt,
    except its last BUNDLED_VALIDATION_DOCS documents (and any word-for-word copy of them), which
    are held out;
  - dataset="bundled_validation": those held-out documents only (the [validation] split of the
    bundled corpus; no training run with dataset="bundled" ever reads them).
  - dataset_path=<file | folder | glob> (any dataset name): local files, by extension:
      .txt   one document per paragraph; paragraphs are separated by one or more blank lines
             (a file without blank lines is therefore one document)
      .jsonl / .json (JSON Lines) and their .gz forms: one document per line, its "text" field
      .parquet: one document per row, its "text" column (read with pyarrow, row group by row group)
    A folder is searched recursively for those extensions; files are taken in sorted path order.
    With dataset="c4" / "c4_validation" and a folder holding allenai/c4's files, only that split's
    files (c4-train.* / c4-validation.*) are read.
  - dataset="c4" / "c4_validation": allenai/c4 "en" from the Hugging Face hub, streamed; any
    "org/name" streams that hub dataset's train split ("text" column). These need a network; without
    one they fail with a message saying so.

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

import glob as _glob
import gzip
import itertools
import json
import os
import re
import sys
from collections import deque
from collections.abc import Iterator

import numpy as np

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
BUNDLED_CORPUS = os.path.join(ASSETS_DIR, "corpus.txt")

TEXT_EXTENSIONS = (".txt",)
JSONL_EXTENSIONS = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_EXTENSIONS = (".parquet",)
_ALL_EXTENSIONS = TEXT_EXTENSIONS + JSONL_EXTENSIONS + PARQUET_EXTENSIONS

# The bundled corpus's last documents form its held-out (validation) split. A fixed count, so the split
# is the same in every run and independent of the shuffle seed; corpus.txt itself is unchanged.
BUNDLED_VALIDATION_DOCS = 100
BUNDLED_SPLITS = {"bundled": "train", "bundled_validation": "validation"}

_HF_KNOWN = {
    "c4": ("allenai/c4", "en", "train"),
    "c4_validation": ("allenai/c4", "en", "validation"),
}
_FIX_HINT = (
    'Use dataset = "bundled" (validation: "bundled_validation") for the corpus shipped with torchtpu, '
    "set dataset_path to local .txt/.jsonl/.parquet files (a file, folder or glob), or name a Hugging Face dataset "
    '("c4" or "org/name") on a machine with network access.'
)


# --------------------------------------------------------------------------------------------
# Sources. A source is a list of units (files) per epoch; a unit yields (index, text) documents
# from a starting document index. `shard_by_unit` says whether ranks split units or documents.
# --------------------------------------------------------------------------------------------


class _Source:
    name: str
    shard_by_unit: bool
    seed: int = 0

    def reseed(self, seed: int) -> None:
        self.seed = seed

    def units(self, epoch: int) -> list:
        raise NotImplementedError

    def documents(self, unit, start: int) -> Iterator[tuple[int, str]]:
        raise NotImplementedError


def bundled_documents(split: str, path: str = BUNDLED_CORPUS) -> list[str]:
    """The bundled corpus's documents of one split ("train" or "validation"), in file order."""
    if split not in ("train", "validation"):
        raise ValueError(f"bundled corpus split {split!r}: allowed: train, validation")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"the bundled corpus {path} is missing from this installation; reinstall torchtpu "
            f"(or regenerate it: python -m torchtpu.train.assets.make_assets)"
        )
    with open(path, encoding="utf-8") as f:
        docs = [d.strip() for d in re.split(r"\n\s*\n", f.read()) if d.strip()]
    cut = len(docs) - BUNDLED_VALIDATION_DOCS
    held = docs[cut:]
    if split == "validation":
        return held
    # The generator repeats some short documents word for word: a copy of a held-out document
    # elsewhere in the corpus is held out too, so no held-out text is ever trained on.
    held_texts = set(held)
    return [d for d in docs[:cut] if d not in held_texts]


class _BundledSource(_Source):
    """The shipped corpus (one split of it): one unit whose documents are reshuffled every epoch."""

    shard_by_unit = False

    def __init__(self, seed: int, path: str = BUNDLED_CORPUS, split: str = "train"):
        self.name = "bundled" if split == "train" else f"bundled_{split}"
        self._docs = bundled_documents(split, path)
        self.seed = seed
        self._order_epoch = None
        self._order = None

    def reseed(self, seed: int) -> None:
        self.seed = seed
        self._order_epoch = None

    def units(self, epoch: int) -> list:
        return [epoch]

    def documents(self, unit, start: int):
        epoch = unit
        if self._order_epoch != epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self._docs))
            self._order_epoch = epoch
        order = self._order  # this generator's own: several row streams share the source, at other epochs
        for i in range(start, len(self._docs)):
            yield i, self._docs[order[i]]


def _has_ext(path: str, exts) -> bool:
    low = path.lower()
    return any(low.endswith(e) for e in exts)


def _find_files(dataset_path: str) -> list[str]:
    path = os.path.expanduser(dataset_path)
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files = []
        for root, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files += [os.path.join(root, n) for n in names if not n.startswith(".") and _has_ext(n, _ALL_EXTENSIONS)]
        if not files:
            raise FileNotFoundError(
                f"dataset_path {path} is a folder with no .txt, .jsonl/.json(.gz) or .parquet files in it. " + _FIX_HINT
            )
    elif any(ch in path for ch in "*?["):
        files = [p for p in _glob.glob(path, recursive=True) if os.path.isfile(p)]
        if not files:
            raise FileNotFoundError(f"dataset_path glob {path!r} matches no files. " + _FIX_HINT)
    else:
        raise FileNotFoundError(f"dataset_path {path} does not exist. " + _FIX_HINT)
    files = sorted(os.path.abspath(p) for p in files)
    unknown = [p for p in files if not _has_ext(p, _ALL_EXTENSIONS)]
    if unknown:
        raise ValueError(
            f"cannot read {unknown[0]}: torchtpu reads .txt (blank-line separated documents), "
            f'.jsonl/.json(.gz) (a "text" field per line) and .parquet (a "text" column) files'
        )
    return files


class _FilesSource(_Source):
    def __init__(self, dataset_path: str, seed: int, dp_rank: int, dp_world_size: int, split: str | None = None):
        self.name = f"files:{dataset_path}"
        files = _find_files(dataset_path)
        if split:  # a local copy of a hub dataset holding several splits, e.g. c4-train.*.json.gz
            chosen = [p for p in files if f"-{split}." in os.path.basename(p) or f"{split}-" in os.path.basename(p)]
            files = chosen or files
        self.shard_by_unit = len(files) >= dp_world_size > 1
        self._files = files[dp_rank::dp_world_size] if self.shard_by_unit else files
        self.seed = seed

    def units(self, epoch: int) -> list:
        order = np.random.default_rng([self.seed, epoch, 1]).permutation(len(self._files))
        return [self._files[i] for i in order]

    def documents(self, unit, start: int):
        if _has_ext(unit, TEXT_EXTENSIONS):
            yield from _txt_documents(unit, start)
        elif _has_ext(unit, PARQUET_EXTENSIONS):
            yield from _parquet_documents(unit, start)
        else:
            yield from _jsonl_documents(unit, start)


def _txt_documents(path: str, start: int):
    index = 0
    lines: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                lines.append(line)
                continue
            if lines:
                if index >= start:
                    yield index, "".join(lines).strip()
                index += 1
                lines = []
        if lines and index >= start:
            yield index, "".join(lines).strip()


class BadRecord:
    """A malformed record in a document stream, in place of its text: what is wrong and where."""

    def __init__(self, message: str):
        self.message = message


class BadRecords:
    """The malformed records this process's loaders skipped, up to [training] max_bad_records."""

    def __init__(self, limit: int = 0):
        self.limit = int(limit)
        self.count = 0

    def skip(self, record: BadRecord) -> None:
        """Count `record`, or raise ValueError naming it once more than `limit` were skipped."""
        self.count += 1
        if self.count > self.limit:
            if self.limit:
                raise ValueError(
                    f"{record.message} ({self.count} bad records, [training] max_bad_records = {self.limit})"
                )
            raise ValueError(f"{record.message} (set [training] max_bad_records to skip and count a few such records)")
        print(
            f"[torchtpu-train] skipped a bad data record ({self.count} of at most {self.limit}): {record.message}",
            file=sys.stderr,
            flush=True,
        )


def _jsonl_documents(path: str, start: int):
    opener = gzip.open if path.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        index = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if index >= start:
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    yield (
                        index,
                        BadRecord(f"{path}:{lineno} is not valid JSON ({exc}); expected one JSON object per line"),
                    )
                else:
                    if isinstance(record, dict) and "text" in record:
                        yield index, str(record["text"])
                    else:
                        yield index, BadRecord(f'{path}:{lineno} has no "text" field; each JSON line needs one')
            index += 1


def _parquet_documents(path: str, start: int):
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if "text" not in pf.schema_arrow.names:
        raise ValueError(f'{path} has no "text" column (columns: {", ".join(pf.schema_arrow.names)})')
    first = 0
    for g in range(pf.num_row_groups):
        rows = pf.metadata.row_group(g).num_rows
        if first + rows > start:
            column = pf.read_row_group(g, columns=["text"]).column("text").to_pylist()
            for j in range(max(0, start - first), rows):
                yield first + j, column[j] or ""
        first += rows


class _HFStreamSource(_Source):
    """A streaming Hugging Face dataset, split by rank. Resuming re-reads and discards this rank's
    first `start` rows (datasets' own skip() counts rows before the split by rank)."""

    shard_by_unit = True

    def __init__(self, ds, name: str, dp_rank: int, dp_world_size: int):
        from datasets.distributed import split_dataset_by_node

        self.name = f"hf:{name}"
        self._ds = split_dataset_by_node(ds, rank=dp_rank, world_size=dp_world_size) if dp_world_size > 1 else ds

    def units(self, epoch: int) -> list:
        return [epoch]

    def documents(self, unit, start: int):
        rows = itertools.islice(iter(self._ds), start, None)
        for i, row in enumerate(rows, start):
            if "text" not in row:
                raise ValueError(f'{self.name}: rows have no "text" column (columns: {", ".join(row)})')
            yield i, row["text"] or ""


def _check_network(what: str) -> None:
    offline = [
        v
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
        if os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
    ]
    if offline:
        raise ConnectionError(
            f"dataset {what!r} streams from the Hugging Face hub, but {offline[0]} is set (offline). " + _FIX_HINT
        )
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # a proxy decides; let datasets try
    import socket

    try:
        socket.create_connection(("huggingface.co", 443), timeout=5).close()
    except OSError as exc:
        raise ConnectionError(
            f"dataset {what!r} streams from the Hugging Face hub, but huggingface.co is unreachable from "
            f"this machine ({exc}). " + _FIX_HINT
        ) from exc


def _hf_source(dataset: str, dp_rank: int, dp_world_size: int) -> _HFStreamSource:
    path, config, split = _HF_KNOWN.get(dataset, (dataset, None, "train"))
    _check_network(dataset)
    from datasets import load_dataset

    ds = load_dataset(path, name=config, split=split, streaming=True)
    return _HFStreamSource(ds, dataset, dp_rank, dp_world_size)


def _make_source(dataset: str, dataset_path: str | None, seed: int, dp_rank: int, dp_world_size: int) -> _Source:
    name = (dataset or "").strip()
    if dataset_path:
        split = _HF_KNOWN[name][2] if name in _HF_KNOWN else None
        return _FilesSource(dataset_path, seed, dp_rank, dp_world_size, split)
    if name in ("", "bundled"):
        return _BundledSource(seed)
    if name in BUNDLED_SPLITS:
        return _BundledSource(seed, split=BUNDLED_SPLITS[name])
    if name == "c4_test":
        raise ValueError(
            'dataset "c4_test" is a sample that lives in torchtitan\'s source repository, not in the '
            "installed package. " + _FIX_HINT
        )
    if name in _HF_KNOWN or re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        return _hf_source(name, dp_rank, dp_world_size)
    raise ValueError(f"unknown dataset {name!r} and no dataset_path given. " + _FIX_HINT)


# --------------------------------------------------------------------------------------------
# The loader
# --------------------------------------------------------------------------------------------


class TokenBatchLoader:
    """Iterator of (inputs, labels) numpy int64 arrays of shape (local_batch_size, seq_len)."""

    def __init__(
        self,
        source: _Source,
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
    source = _make_source(dataset, dataset_path, seed, dp_rank, dp_world_size)
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

    def make_source(r):
        if "bundled" in shared:  # one copy of the bundled corpus serves every row (it is not rank-dependent)
            return shared["bundled"]
        src = _make_source(dataset, dataset_path, seed, r, global_rows)
        if isinstance(src, _BundledSource):
            shared["bundled"] = src
        return src

    return GlobalBatchLoader(
        make_source,
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
