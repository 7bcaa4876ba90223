"""Bundled corpus and tokenizer, tokenizer loading, and the packed, sharded, resumable data loader."""

import base64
import gzip
import json
import os
import shutil

import numpy as np
import pytest

from torchtpu.train import data as D
from torchtpu.train import documents
from torchtpu.train.assets import make_assets
from torchtpu.train.data import build_dataloader
from torchtpu.train.tokenizer import BUNDLED_TOKENIZER, build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None)


def _docs(n, prefix="doc"):
    return [f"{prefix} {i} says hello number {i}. The cat sat on mat {i}." for i in range(n)]


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _same(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)


def _write_jsonl(path, docs, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": 0}) + "\n")


def _doc_ids_seen(tok, batches, prefix="doc"):
    """Document numbers whose full text appears in the decoded stream."""
    text = "".join(tok.decode(np.concatenate([x, y[:, -1:]], axis=1).ravel()) for x, y in batches)
    return {
        int(part.split(" ", 1)[0])
        for part in text.split(f"<|begin_of_text|>{prefix} ")[1:]
        if "<|end_of_text|>" in part
    }


# ---------------------------------------------------------------------------- bundled assets


def test_bundled_tokenizer(tok):
    assert tok.vocab_size <= 2048
    assert tok.bos_id != tok.eos_id
    text = open(documents.BUNDLED_CORPUS, encoding="utf-8").read()[:20000]
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert max(ids) < 2048 and min(ids) >= 0
    assert tok.decode(ids[1:-1]) == text
    assert tok.encode("x", bos=False, eos=False) == tok.encode("x")[1:-1]
    # byte-level: text outside the corpus still round-trips
    odd = "Zürich – 東京 🙂 {x: 1}"
    assert tok.decode(tok.encode(odd, bos=False, eos=False)) == odd


def test_bundled_assets_are_reproducible():
    docs = make_assets.generate_documents()
    with open(make_assets.CORPUS_FILE, encoding="utf-8") as f:
        assert f.read() == make_assets.corpus_text(docs)
    size = os.path.getsize(make_assets.CORPUS_FILE)
    assert 300_000 < size < 2_500_000
    with open(make_assets.TOKENIZER_FILE, encoding="utf-8") as f:
        assert json.loads(f.read()) == json.loads(make_assets.train_tokenizer(docs).to_str())


def test_bundled_corpus_is_learnable(tok):
    """A tiny Llama 3 (torchtitan's model) on the bundled loader: loss < 60% of its first value."""
    import torch
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is fastest on a busy machine
    args = TransformerModelArgs(dim=64, n_layers=1, n_heads=4, vocab_size=2048, max_seq_len=64, rope_theta=500000)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = build_dataloader("bundled", None, tok, 64, 8, 0, 1)
    losses = []
    try:
        for _step in range(60):
            x, y = next(loader)
            logits = model(torch.from_numpy(x))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(y).flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if loss.item() < 0.6 * losses[0]:
                break
    finally:
        torch.set_num_threads(threads)
    assert losses[-1] < 0.6 * losses[0], losses


# ---------------------------------------------------------------------------- tokenizers


def test_hf_tokenizer_from_folder_and_file(tmp_path):
    shutil.copy(BUNDLED_TOKENIZER, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )
    for path in (str(tmp_path), str(tmp_path / "tokenizer.json")):
        t = build_tokenizer(path)
        ids = t.encode("The cat says meow.")
        assert ids[0] == t.bos_id == 0 and ids[-1] == t.eos_id == 1
        assert t.decode(ids[1:-1]) == "The cat says meow."
    assert build_tokenizer("").vocab_size == build_tokenizer(None).vocab_size


def _write_ranks(path):
    ranks = {bytes([i]): i for i in range(256)}
    for piece in (b"th", b"he", b"the", b" t", b" the", b"ca", b"cat", b" cat"):
        ranks[piece] = len(ranks)
    with open(path, "w") as f:
        for piece, rank in ranks.items():
            f.write(f"{base64.b64encode(piece).decode()} {rank}\n")
    return len(ranks)


def test_tiktoken_tokenizer(tmp_path):
    n = _write_ranks(tmp_path / "tokenizer.model")
    t = build_tokenizer(str(tmp_path))
    assert (t.bos_id, t.eos_id, t.vocab_size) == (n, n + 1, n + 256)
    text = "the cat, the hat <|end_of_text|> 123"
    ids = t.encode(text, bos=True, eos=True)
    assert ids[0] == n and ids[-1] == n + 1
    assert n + 1 not in ids[1:-1]  # special-token text inside a document stays text
    assert t.decode(ids[1:-1]) == text
    assert t.encode("the", bos=False, eos=False) == [258]


def test_tokenizer_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.*hf_assets_path"):
        build_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        build_tokenizer(str(tmp_path))


# ---------------------------------------------------------------------------- packing and formats


def test_packing_matches_concatenated_documents(tmp_path, tok):
    docs = _docs(30)
    (tmp_path / "a.txt").write_text("\n\n".join(docs) + "\n")
    seq, bs = 16, 3
    stream = np.concatenate([tok.encode(d) for d in docs])
    loader = build_dataloader("local", str(tmp_path / "a.txt"), tok, seq, bs, 0, 1, infinite=False)
    batches = list(loader)
    window = seq + 1
    assert len(batches) == len(stream) // (window * bs)
    for b, (x, y) in enumerate(batches):
        assert x.shape == y.shape == (bs, seq) and x.dtype == np.int64
        expect = stream[b * bs * window : (b + 1) * bs * window].reshape(bs, window)
        np.testing.assert_array_equal(x, expect[:, :-1])
        np.testing.assert_array_equal(y, expect[:, 1:])


def test_txt_paragraphs_jsonl_parquet_dir_and_glob(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _docs(24)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "part0.txt").write_text("\n\n\n".join(docs[:8]) + "\n")
    _write_jsonl(tmp_path / "d" / "part1.jsonl", docs[8:12])
    _write_jsonl(tmp_path / "d" / "part2.jsonl.gz", docs[12:16], gz=True)
    pq.write_table(
        pa.table({"text": docs[16:], "n": list(range(8))}), tmp_path / "d" / "part3.parquet", row_group_size=3
    )
    for path in (str(tmp_path / "d"), str(tmp_path / "d" / "part*")):
        # two epochs' worth of tokens: every document of every format shows up whole
        batches = _take(build_dataloader("local", path, tok, 8, 4, 0, 1), 30)
        assert _doc_ids_seen(tok, batches) == set(range(24))


def test_local_c4_copy_reads_the_named_split(tmp_path, tok):
    _write_jsonl(tmp_path / "c4-train.00000-of-00002.json.gz", _docs(5, prefix="train"), gz=True)
    _write_jsonl(tmp_path / "c4-train.00001-of-00002.json.gz", _docs(5, prefix="train"), gz=True)
    _write_jsonl(tmp_path / "c4-validation.00000-of-00001.json.gz", _docs(5, prefix="valid"), gz=True)
    for name, want, other in (("c4", "train", "valid"), ("c4_validation", "valid", "train")):
        text = "".join(
            tok.decode(x.ravel()) for x, _ in _take(build_dataloader(name, str(tmp_path), tok, 8, 2, 0, 1), 12)
        )
        assert want in text and other not in text


def test_rank_shards_documents(tmp_path, tok):
    docs = _docs(40)
    _write_jsonl(tmp_path / "one.jsonl", docs)
    seen = []
    for rank in range(2):
        batches = list(build_dataloader("x", str(tmp_path / "one.jsonl"), tok, 8, 2, rank, 2, infinite=False))
        seen.append(_doc_ids_seen(tok, batches))
        assert seen[rank] and all(i % 2 == rank for i in seen[rank]), seen[rank]
    assert not seen[0] & seen[1]


def test_rank_shards_files(tmp_path, tok):
    for f in range(4):
        _write_jsonl(tmp_path / f"f{f}.jsonl", _docs(6, prefix=f"file{f}"))
    for rank in range(2):
        loader = build_dataloader("x", str(tmp_path), tok, 8, 1, rank, 2, infinite=False)
        text = "".join(tok.decode(x.ravel()) for x, _ in loader)
        present = {f for f in range(4) if f"file{f} " in text}
        assert present == {rank, rank + 2}


# ---------------------------------------------------------------------------- resuming


@pytest.mark.parametrize("kind", ["bundled", "jsonl", "parquet", "txt_small_wraps_epochs"])
def test_resume_yields_the_same_batches(tmp_path, tok, kind):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = None
    if kind == "jsonl":
        _write_jsonl(tmp_path / "a.jsonl", _docs(50))
        path = str(tmp_path / "a.jsonl")
    elif kind == "parquet":
        pq.write_table(pa.table({"text": _docs(50)}), tmp_path / "a.parquet", row_group_size=7)
        path = str(tmp_path / "a.parquet")
    elif kind.startswith("txt"):
        for f in range(3):
            (tmp_path / f"{f}.txt").write_text("\n\n".join(_docs(5, prefix=f"f{f}")))
        path = str(tmp_path)
    world = 1 if kind.startswith("txt") else 2
    args = ("bundled" if path is None else "local", path, tok, 24, 2, 1 % world, world)
    loader = build_dataloader(*args, seed=3)
    first = _take(loader, 7 if path else 4)
    state = loader.state_dict()
    assert all(isinstance(v, (int, str)) for v in state.values())
    json.dumps(state)
    rest = _take(loader, 25)
    fresh = build_dataloader(*args, seed=5)  # the saved seed wins
    fresh.load_state_dict(json.loads(json.dumps(state)))
    _same(rest, _take(fresh, 25))
    if kind.startswith("txt"):
        assert loader.state_dict()["epoch"] >= 1  # the run crossed epoch boundaries
        # each epoch reshuffles the files; the same seed gives the same order
        again = build_dataloader(*args, seed=3)
        _same(first + rest, _take(again, len(first) + len(rest)))


def test_state_rejects_another_layout(tok):
    state = build_dataloader("bundled", None, tok, 8, 1, 0, 2).state_dict()
    with pytest.raises(ValueError, match="dp_world_size"):
        build_dataloader("bundled", None, tok, 8, 1, 0, 4).load_state_dict(state)


def test_hf_streaming_source_local_json(tmp_path, tok, monkeypatch):
    """The Hugging Face streaming path, on a local JSON file (no network)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from datasets import load_dataset

    _write_jsonl(tmp_path / "a.jsonl", _docs(40))

    def make(rank):
        ds = load_dataset("json", data_files=str(tmp_path / "a.jsonl"), split="train", streaming=True)
        return D.TokenBatchLoader(documents.HFStreamSource(ds, "local-json", rank, 2), tok, 8, 2, rank, 2)

    seen = []
    for rank in range(2):
        loader = make(rank)
        batches = _take(loader, 4)
        seen.append(_doc_ids_seen(tok, batches))
        state = loader.state_dict()
        rest = _take(loader, 3)
        fresh = make(rank)
        fresh.load_state_dict(state)
        _same(rest, _take(fresh, 3))
    assert seen[0] and seen[1] and not seen[0] & seen[1]


# ---------------------------------------------------------------------------- errors


def test_errors_name_the_problem_and_fix(tmp_path, tok, monkeypatch):
    with pytest.raises(ValueError, match="unknown dataset 'nonsense'.*bundled"):
        build_dataloader("nonsense", None, tok, 8, 1, 0, 1)
    with pytest.raises(FileNotFoundError, match="missing_dir.*does not exist.*bundled"):
        build_dataloader("bundled", str(tmp_path / "missing_dir"), tok, 8, 1, 0, 1)
    with pytest.raises(FileNotFoundError, match="matches no files"):
        build_dataloader("x", str(tmp_path / "*.parquet"), tok, 8, 1, 0, 1)
    with pytest.raises(ValueError, match="c4_test"):
        build_dataloader("c4_test", None, tok, 8, 1, 0, 1)
    (tmp_path / "bad.jsonl").write_text('{"body": "no text"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1.*text"):
        next(build_dataloader("x", str(tmp_path / "bad.jsonl"), tok, 8, 1, 0, 1))
    # Hub datasets need a network: with the hub marked offline they fail before any connection.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("c4", "someorg/somedata"):
        with pytest.raises(ConnectionError, match="offline.*bundled"):
            build_dataloader(name, None, tok, 8, 1, 0, 1)


def test_rank_without_documents_fails_clearly(tmp_path, tok):
    (tmp_path / "a.txt").write_text("only one document")
    loader = build_dataloader("x", str(tmp_path / "a.txt"), tok, 8, 1, 1, 2)
    with pytest.raises(ValueError, match="rank 1 of 2 got no documents"):
        next(loader)


# ---------------------------------------------------------------------------------------------
# The trainer's global batch: one stream per row, the same rows whatever reads them
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bundled", "files"])
def test_global_batch_rows_do_not_depend_on_the_split(tmp_path, tok, kind):
    """Rows read by 1, 2 or 4 'processes' (any subsets) are the rows of the whole batch; row r is the
    stream of documents r, r + G, ... (one sequence per batch), independently of any other row."""
    from torchtpu.train.data import build_global_batch_loader

    path = None
    if kind == "files":  # 6 files >= 4 rows: rows split whole files
        for f in range(6):
            (tmp_path / f"{f}.txt").write_text("\n\n".join(_docs(9, prefix=f"f{f}")))
        path = str(tmp_path)
    args = ("bundled" if path is None else "local", path, tok, 16, 4)
    full = _take(build_global_batch_loader(*args, seed=2), 12)
    assert full[0][0].shape == (4, 16)
    for split in ([[0, 1, 2, 3]], [[0, 1], [2, 3]], [[3], [1], [0, 2]]):
        parts = [_take(build_global_batch_loader(*args, rows=rows, seed=2), 12) for rows in split]
        for k in range(12):
            for rows, part in zip(split, parts):
                np.testing.assert_array_equal(part[k][0], full[k][0][sorted(rows)])
                np.testing.assert_array_equal(part[k][1], full[k][1][sorted(rows)])
    # row r alone is rank r of 4 of the per-rank loader, one sequence at a time
    for r in range(4):
        alone = _take(build_dataloader(*args[:4], 1, r, 4, seed=2), 12)
        for k in range(12):
            np.testing.assert_array_equal(alone[k][0][0], full[k][0][r])


def test_global_batch_state_is_per_row_and_resumes_on_another_split(tok):
    from torchtpu.train.data import build_global_batch_loader

    one = build_global_batch_loader("bundled", None, tok, 16, 4, seed=1)
    _take(one, 5)
    state = json.loads(json.dumps({"global_rows": 4, "streams": [one.state_dict()["streams"][r] for r in range(4)]}))
    want = _take(one, 6)
    for rows in ([0, 1], [2, 3]):  # two "processes" resume the rows they now hold
        half = build_global_batch_loader("bundled", None, tok, 16, 4, rows=rows, seed=9)  # the saved seed wins
        half.load_state_dict(state)
        for (x, y), (wx, wy) in zip(_take(half, 6), want):
            np.testing.assert_array_equal(x, wx[rows])
            np.testing.assert_array_equal(y, wy[rows])
    with pytest.raises(ValueError, match="global batch of 4 row streams but this loader has 8"):
        build_global_batch_loader("bundled", None, tok, 16, 8).load_state_dict(state)
    with pytest.raises(ValueError, match="rows"):
        build_global_batch_loader("bundled", None, tok, 16, 4, rows=[4])


def test_bad_records_are_skipped_and_counted_up_to_max_bad_records(tmp_path, tok, capsys):
    """[training] max_bad_records: a few malformed JSON lines are skipped and counted once each (by the
    row stream that owns them), the next one is an error naming its file:line; 0 fails on the first."""
    docs = [f"document number {i} " * 20 for i in range(12)]
    lines = [json.dumps({"text": d}) for d in docs]
    lines[1] = '{"text": "cut off'  # rows 1 and 2 of 4 own documents 1 and 2: their first ones
    lines[2] = json.dumps({"body": "no text field"})
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")

    def first_batches(limit):
        loader = D.build_global_batch_loader("files", str(path), tok, 16, 4, max_bad_records=limit, infinite=False)
        batches = [next(loader) for _ in range(6)]
        return loader, batches

    loader, batches = first_batches(2)
    assert loader.bad_records.count == 2  # 4 row streams read every line; each bad one is counted once
    assert "skipped a bad data record (1 of at most 2)" in capsys.readouterr().err
    assert batches[0][0].shape == (4, 16)
    # a resume continues the count: both records lie before the saved position, so they are not read again
    resumed = D.build_global_batch_loader("files", str(path), tok, 16, 4, max_bad_records=2, infinite=False)
    resumed.load_state_dict(loader.state_dict())
    assert resumed.bad_records.count == 2
    np.testing.assert_array_equal(next(resumed)[0], next(loader)[0])
    assert resumed.bad_records.count == 2 and "skipped a bad data record" not in capsys.readouterr().err
    with pytest.raises(ValueError, match=rf"{path}:2 is not valid JSON .*set \[training\] max_bad_records"):
        first_batches(0)
    with pytest.raises(
        ValueError, match=rf'{path}:3 has no "text" field.*2 bad records, \[training\] max_bad_records = 1'
    ):
        first_batches(1)
