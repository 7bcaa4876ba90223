"""Documents for the token loaders (data.py): where the text comes from, one document at a time.

    source = make_source(dataset, dataset_path, seed, dp_rank, dp_world_size)
    for unit in source.units(epoch):                       # files (or one corpus) in this epoch's order
        for index, text in source.documents(unit, start):  # text, or a BadRecord in its place
            ...

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

A malformed record (a JSON line that does not parse or has no "text") is yielded as a BadRecord in
place of its text; BadRecords counts the ones a loader skips, up to [training] max_bad_records.
"""

from __future__ import annotations

import glob as _glob
import gzip
import itertools
import json
import os
import re
import sys
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


class Source:
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


class BundledSource(Source):
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


class _FilesSource(Source):
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


class HFStreamSource(Source):
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


def _hf_source(dataset: str, dp_rank: int, dp_world_size: int) -> HFStreamSource:
    path, config, split = _HF_KNOWN.get(dataset, (dataset, None, "train"))
    _check_network(dataset)
    from datasets import load_dataset

    ds = load_dataset(path, name=config, split=split, streaming=True)
    return HFStreamSource(ds, dataset, dp_rank, dp_world_size)


def make_source(dataset: str, dataset_path: str | None, seed: int, dp_rank: int, dp_world_size: int) -> Source:
    name = (dataset or "").strip()
    if dataset_path:
        split = _HF_KNOWN[name][2] if name in _HF_KNOWN else None
        return _FilesSource(dataset_path, seed, dp_rank, dp_world_size, split)
    if name in ("", "bundled"):
        return BundledSource(seed)
    if name in BUNDLED_SPLITS:
        return BundledSource(seed, split=BUNDLED_SPLITS[name])
    if name == "c4_test":
        raise ValueError(
            'dataset "c4_test" is a sample that lives in torchtitan\'s source repository, not in the '
            "installed package. " + _FIX_HINT
        )
    if name in _HF_KNOWN or re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        return _hf_source(name, dp_rank, dp_world_size)
    raise ValueError(f"unknown dataset {name!r} and no dataset_path given. " + _FIX_HINT)
