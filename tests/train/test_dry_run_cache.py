"""The dry run's cache of compile reports (torchtpu/train/dry_run/cache.py): a repeated dry run of
the same program prints what compiling again would, without compiling; any change to the program
compiles again; a damaged cache is a miss, never an error."""

import json
import re

import pytest

pytestmark = pytest.mark.xdist_group("dry_run_cache")

ARGV = ["--config", "train_configs/debug_model.toml", "--dry-run", "--training.steps", "2"]

# The debug model with 2 blocks, costed from 0- and 1-block copies (instead of 6 from 2 and 4): still a
# full program and two costing copies, each with its own record, at a quarter of the layers to lower
# and compile. What is checked is the cache of their reports, not the estimate (test_dry_run.py).
N_LAYERS, COSTING_DEPTHS = 2, (0, 1)


def _dry_run(tmp_path, capsys, monkeypatch, extra=()):
    """(printed lines, number of XLA compiles) of one dry run of the debug model on the CPU devices."""
    import torchtpu.backend.aot as aot
    import torchtpu.train.dry_run.estimate as estimate
    from torchtpu.train.config.manager import load_config
    from torchtpu.train.dry_run.estimate import dry_run
    from torchtpu.train.trainer import Trainer

    compiles = []
    real = aot.aot_compile

    def counted(lowered, *a, **k):
        compiles.append(1)
        return real(lowered, *a, **k)

    monkeypatch.setattr(aot, "aot_compile", counted)
    monkeypatch.setattr(estimate, "COSTING_DEPTHS", COSTING_DEPTHS)
    argv = ARGV + ["--job.dump_folder", str(tmp_path / "job")] + list(extra)
    assert dry_run(Trainer(load_config(argv), n_layers=N_LAYERS).built_step()) == 0
    return capsys.readouterr().out.splitlines(), len(compiles)


_PHASE = re.compile(
    r"^dry run: .*( \.\.\.|: still working, \d+ s|: done in [\d.]+ s|: its report is in the dry-run cache .*)$"
)


def _figures(lines):
    """The printed lines less the progress lines and what says where a figure came from: the cache
    notes, and the compile time (measured: a program compiled again takes another time)."""
    out = []
    for line in lines:
        if _PHASE.match(line):  # progress: a phase started, still working, done, or read from the cache
            continue
        if line.startswith("compile time"):
            line = "compile time"
        line = re.sub(r" \(costing programs' figures from the dry-run cache: .*\)$", "", line)
        out.append(line)
    return out


def test_a_repeated_dry_run_prints_the_same_report_from_the_cache(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHTPU_DRY_RUN_CACHE", "on")
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path / "cache"))

    first, n_first = _dry_run(tmp_path, capsys, monkeypatch)
    assert n_first == 3  # the step, and its 0- and 1-layer costing copies (2 layers: extrapolated)
    assert not any("dry-run cache" in line for line in first)
    records = sorted((tmp_path / "cache" / "dry_run").glob("*.json"))
    assert len(records) == 3

    again, n_again = _dry_run(tmp_path, capsys, monkeypatch)
    assert n_again == 0
    assert _figures(again) == _figures(first)
    assert any(line.startswith("compile time") and "from the dry-run cache" in line for line in again), again
    assert any(
        line.startswith("costing method") and "0-layer from" in line and "1-layer from" in line for line in again
    ), again

    # another learning rate is not another program: still cached
    _, n_lr = _dry_run(tmp_path, capsys, monkeypatch, ["--optimizer.lr", "1e-3"])
    assert n_lr == 0

    # another sequence length is: all three compile again, and are kept next to the others
    shorter, n_seq = _dry_run(tmp_path, capsys, monkeypatch, ["--training.seq_len", "1024"])
    assert n_seq == 3
    assert _figures(shorter) != _figures(first)
    assert len(list((tmp_path / "cache" / "dry_run").glob("*.json"))) == 6

    # damaged records (a half-written file, another program's record) are misses, replaced
    records[0].write_text('{"key": "')
    other = json.loads(records[2].read_text())
    records[1].write_text(json.dumps({**other, "key": "not this one"}))
    repaired, n_repaired = _dry_run(tmp_path, capsys, monkeypatch)
    assert n_repaired == 2
    assert _figures(repaired) == _figures(first)
    _, n_after = _dry_run(tmp_path, capsys, monkeypatch)
    assert n_after == 0


def test_the_cache_is_off_on_request(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHTPU_DRY_RUN_CACHE", "off")
    _, n = _dry_run(tmp_path, capsys, monkeypatch)
    assert n == 3
    # nothing written (so a second dry run has nothing to read: it would compile again)
    assert not (tmp_path / "cache" / "dry_run").exists()
