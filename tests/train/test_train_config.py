"""The trainer's configuration layer and the torchtpu-train command line.

Subprocess checks (real exit codes, no tracebacks) run concurrently once per module; the rest
run in-process through torchtpu.cli.train_main, which is what the console script calls.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import tomllib
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from torchtpu import cli
from torchtpu.train import parallel_dims as P
from torchtpu.train.config import job_config as S
from torchtpu.train.config import manager as C
from torchtpu.train.config import schema
from torchtpu.train.xla_env import xla_env_updates

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "train_configs"
PY = sys.executable
SHIPPED = {  # file -> (devices of the slice it is written for, topology)
    "debug_model.toml": (8, "v5e:2x4"),
    "llama3_8b.toml": (4, "v5p:2x2x1"),
    "llama3_70b.toml": (64, "v5p:4x4x4"),
    "llama3_405b.toml": (512, "v5p:8x8x8"),
    "qwen3_30b_a3b.toml": (16, "v5p:2x2x4"),
    "deepseek_v3_16b.toml": (8, "v5p:2x2x2"),
    "deepseek_v3_671b.toml": (512, "v5p:8x8x8"),
    "llama4_17bx16e.toml": (64, "v5p:4x4x4"),
}


def leaf_paths():
    return [path for path, _ in schema.walk(S.JobConfig)]


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


@pytest.fixture(autouse=True)
def _own_folder(tmp_path, monkeypatch):
    """Relative paths in the shipped configs (`./outputs/...`) land in this test's folder: a dump-folder
    lock taken in-process is then this test's own, not one that another worker of the suite holds."""
    monkeypatch.chdir(tmp_path)


def run_cli(argv, capsys):
    status = cli.train_main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


# ----------------------------------------------------------------------------------------------
# Subprocesses, started together
# ----------------------------------------------------------------------------------------------

_RAISING_TRAINER = """
import sys, types
mod = types.ModuleType("torchtpu.train.trainer")
def main(cfg):
    raise RuntimeError("the step blew up\\nsecond line of detail")
mod.main = main
sys.modules["torchtpu.train.trainer"] = mod
from torchtpu.cli import train_main
sys.exit(train_main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    """Real processes, few of them: each one imports torchtpu (seconds of CPU on this machine)."""
    tmp = tmp_path_factory.mktemp("cli")
    bad = tmp / "bad.toml"
    bad.write_text("[training]\nseq_lenn = 256\n")
    debug = str(CONFIGS / "debug_model.toml")
    cases = {
        "unknown_key": [PY, "-m", "torchtpu.train", "--config", str(bad)],
        # a dump folder of its own: the CLI locks it, and another worker may run the debug config at once
        "runtime": [PY, "-c", _RAISING_TRAINER, "--config", debug, "--job.dump_folder", str(tmp / "runtime")],
    }
    env = dict(os.environ, PYTHONWARNINGS="ignore")

    def one(argv):
        return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        futures = {name: pool.submit(one, argv) for name, argv in cases.items()}
        return {name: f.result() for name, f in futures.items()}


def test_cli_help_lists_every_key_with_default(capsys):
    status, out, err = run_cli(["--help"], capsys)
    assert status == 0 and err == ""
    for path, spec in schema.walk(S.JobConfig):
        option = "--" + ".".join(path)
        line = next(
            (
                ln
                for ln in out.splitlines()
                if ln.strip().startswith(option + " ") or ln.strip().startswith(option + ",")
            ),
            None,
        )
        assert line is not None, f"{option} missing from --help"
        default = "unset" if spec.default is None else schema.fmt(spec.default)
        assert f"(default: {default})" in line
        assert spec.help  # every key has a meaning
    for flag in ("--config", "--dry-run", "--topology", "--debug"):
        assert flag in out


def test_cli_print_config_round_trips(capsys, tmp_path):
    status, out, err = run_cli(
        ["--config", str(CONFIGS / "debug_model.toml"), "--training.steps", "7", "--job.print_config"], capsys
    )
    assert status == 0 and err == ""
    tomllib.loads(out)  # valid TOML
    printed = write(tmp_path, "printed.toml", out)
    again = C.load_config(["--config", printed])
    original = C.load_config(["--config", str(CONFIGS / "debug_model.toml"), "--training.steps", "7"])
    assert again.training.steps == 7
    a, b = again.to_dict(), original.to_dict()
    a["job"].pop("config_file"), b["job"].pop("config_file")
    assert a == b


@pytest.mark.parametrize(
    "case,needles",
    [
        ("unknown_key", ["bad.toml", "[training]", "seq_lenn", "256", "did you mean 'seq_len'"]),
    ],
)
def test_cli_config_errors_exit_2_with_one_line(procs, case, needles):
    p = procs[case]
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    for needle in needles:
        assert needle in lines[0]


def test_cli_other_errors_exit_1_traceback_only_with_debug(procs, monkeypatch, capsys, tmp_path):
    p = procs["runtime"]
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "RuntimeError: the step blew up" in lines[0] and "--debug" in lines[0]

    def main(cfg):
        raise RuntimeError("the step blew up\nsecond line")

    monkeypatch.setitem(sys.modules, "torchtpu.train.trainer", types.SimpleNamespace(main=main))
    own = ["--job.dump_folder", str(tmp_path / "out")]
    status, out, err = run_cli(["--config", str(CONFIGS / "debug_model.toml"), *own], capsys)
    assert status == 1 and err.count("\n") == 1 and "Traceback" not in err
    status, out, err = run_cli(["--config", str(CONFIGS / "debug_model.toml"), "--debug", *own], capsys)
    assert status == 1 and "Traceback" in err
    assert "RuntimeError: the step blew up" in err.strip().splitlines()[-1]


# ----------------------------------------------------------------------------------------------
# Schema
# ----------------------------------------------------------------------------------------------

# torchtpu defaults that differ from torchtitan's on purpose (theirs do not apply on TPU).
DEVIATIONS = {("model", "hf_assets_path"): "", ("compile", "backend"): "tpu"}
TPU_ONLY = {
    ("parallelism", "num_slices"),
    ("parallelism", "dcn_axis"),
    ("debug", "verbose"),
    ("training", "max_bad_records"),
    ("model", "attn_type"),
    ("model", "n_layers"),
    ("model", "flavor_overrides"),
    ("debug", "inject_stall"),
}


def test_names_and_defaults_match_torchtitan():
    from torchtitan.config.job_config import JobConfig as TitanConfig

    titan = TitanConfig().to_dict()

    def titan_get(path):
        d = titan
        for name in path:
            if not isinstance(d, dict) or name not in d:
                return KeyError
            d = d[name]
        return d

    ours = S.JobConfig().to_dict()
    for path in leaf_paths():
        value = ours
        for name in path:
            value = value[name]
        theirs = titan_get(path)
        if path[0] == "tpu" or path in TPU_ONLY:
            assert theirs is KeyError, f"{path} exists in torchtitan"
            continue
        assert theirs is not KeyError, f"{'.'.join(path)} is not a torchtitan 0.2.2 key"
        assert value == DEVIATIONS.get(path, theirs), f"default of {'.'.join(path)}"

    # Every torchtitan key is either ours or on the list that gets a "not supported" message.
    def titan_leaves(d, prefix=()):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from titan_leaves(v, prefix + (k,))
            else:
                yield prefix + (k,)

    mine = set(leaf_paths())
    for path in titan_leaves(titan):
        if path[0] in schema.TORCHTITAN_ONLY_SECTIONS:
            continue
        assert path in mine or path[-1] in schema.TORCHTITAN_ONLY_KEYS.get(path[:-1], ()), path


def test_config_module_imports_only_the_standard_library():
    # The configuration modules and what they read (the hardware facts, the model registry), with
    # torchtpu and torchtpu.train as bare packages so that neither __init__.py runs.
    modules = ("train.config.schema", "train.config.job_config", "train.config.manager", "train.parallel_dims")
    code = (
        "import importlib, sys, types\n"
        "for name in ('torchtpu', 'torchtpu.train'):\n"
        "    pkg = types.ModuleType(name); pkg.__path__ = [sys.argv[1] + name[8:].replace('.', '/')]\n"
        "    sys.modules[name] = pkg\n"
        f"for m in {modules!r}: importlib.import_module('torchtpu.' + m)\n"
        "print(sorted(n for n in ('torch', 'jax', 'numpy', 'torchtitan') if n in sys.modules))"
    )
    out = subprocess.run([PY, "-c", code, str(REPO / "torchtpu")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------------------
# Precedence and option syntax
# ----------------------------------------------------------------------------------------------


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write(
        tmp_path,
        "p.toml",
        """
        [training]
        steps = 50
        local_batch_size = 4
        [optimizer]
        lr = 0.01
    """,
    )
    cfg = C.load_config(["--training.steps", "9", "--config", path, "--training.steps=7"])
    assert cfg.training.steps == 7  # command line, last one wins, wherever --config is
    assert cfg.training.local_batch_size == 4 and cfg.optimizer.lr == 0.01  # file
    assert cfg.training.seq_len == 2048 and cfg.optimizer.beta2 == 0.95  # defaults
    assert cfg.origin("training", "steps") == C.COMMAND_LINE
    assert cfg.origin("optimizer", "lr") == path
    assert cfg.origin("training", "seq_len") is None
    assert cfg.job.config_file == path
    assert C.load_config([]) == S.JobConfig()


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--checkpoint.enable"], True),
        (["--checkpoint.enable", "true"], True),
        (["--checkpoint.enable", "false"], False),
        (["--checkpoint.enable=0"], False),
        (["--checkpoint.enable", "--checkpoint.no-enable"], False),
        (["--checkpoint.no_enable"], False),
        (["--checkpoint.no-enable", "--checkpoint.enable"], True),
    ],
)
def test_bool_flags(tmp_path, argv, expected):
    path = write(tmp_path, "b.toml", "[checkpoint]\nenable = true\n" if not expected else "")
    cfg = C.load_config(["--config", path, *argv, "--training.steps", "3"])
    assert cfg.checkpoint.enable is expected
    assert cfg.training.steps == 3  # the flag did not swallow the next option


def test_general_flags_and_value_syntax():
    cfg = C.load_config(
        [
            "--dry-run",
            "--topology",
            "v5p:4x4x4",
            "--debug",
            "--debug.seed",
            "5",
            "--training.seq-len",
            "64",
            "--compile.components",
            "model",
            "--lr_scheduler.total_steps",
            "none",
            "--parallelism.data_parallel_shard_degree",
            "-1",
            "--training.gc_freq",
            "7",
        ]
    )
    assert cfg.tpu.dry_run and cfg.tpu.topology == "v5p:4x4x4" and cfg.debug.verbose
    assert cfg.debug.seed == 5 and cfg.training.seq_len == 64 and cfg.compile.components == ["model"]
    assert cfg.lr_scheduler.total_steps is None and cfg.training.gc_freq == 7
    assert S.topology_num_devices("v5p:4x4x4") == 64 and S.topology_num_devices("v6e:16x16") == 256


def test_help_via_load_config():
    with pytest.raises(C.HelpRequested) as info:
        C.load_config(["--config", "x.toml", "-h"])
    assert "--training.seq_len" in info.value.text


def test_to_toml_round_trips_every_kind_of_value(tmp_path):
    cfg = C.load_config(
        [
            "--debug.seed",
            "3",
            "--optimizer.lr",
            "1e-05",
            "--lr_scheduler.decay_ratio",
            "0.25",
            "--checkpoint.exclude_from_loading",
            "optimizer,dataloader",
            "--job.description",
            'quote " and \\ backslash',
            "--checkpoint.enable",
            "--training.max_norm",
            "2",
        ]
    )
    text = cfg.to_toml()
    again = C.load_config(["--config", write(tmp_path, "r.toml", text)])
    a, b = again.to_dict(), cfg.to_dict()
    a["job"].pop("config_file"), b["job"].pop("config_file")
    assert a == b
    assert C.config_from_dict(cfg.to_dict()) == cfg
    assert isinstance(cfg.training.max_norm, float)


def test_print_config_in_process(capsys):
    status, out, err = run_cli(["--config", str(CONFIGS / "llama3_70b.toml"), "--job.print_config"], capsys)
    assert status == 0 and err == ""
    data = tomllib.loads(out)
    assert data["model"]["flavor"] == "70B" and data["job"]["print_config"] is False


# ----------------------------------------------------------------------------------------------
# Shipped configs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_parses_and_validates(name):
    devices, topology = SHIPPED[name]
    path = CONFIGS / name
    cfg = C.load_config(["--config", str(path)])
    dims = P.resolve_dims(cfg, devices)
    assert dims.world_size == devices
    assert dims.dp_replicate * dims.dp_shard * dims.tp == devices
    assert dims.global_batch_size == dims.local_batch_size * dims.dp * dims.grad_accum_steps
    assert S.topology_num_devices(topology) == devices
    head = path.read_text().split("\n[", 1)[0]
    assert head.startswith("#")
    if name != "debug_model.toml":
        assert topology in head and "YOU MUST SET" in head and "hf_assets_path" in head
        assert cfg.training.dataset == "c4" and cfg.model.hf_assets_path == ""
        assert cfg.training.mixed_precision_param == "bfloat16"
        assert cfg.training.mixed_precision_reduce == "float32"
        assert cfg.activation_checkpoint.mode in ("full", "selective")
    # and through the command line, against the named slice
    assert P.resolve_dims(C.load_config(["--config", str(path), "--topology", topology]), devices) == dims


def test_shipped_config_details():
    debug = C.load_config(["--config", str(CONFIGS / "debug_model.toml")])
    assert (debug.model.name, debug.model.flavor, debug.training.dataset) == ("llama3", "debugmodel", "bundled")
    assert debug.model.hf_assets_path == "" and debug.checkpoint.enable is False
    assert debug.training.seq_len in (128, 256) and debug.metrics.log_freq == 10
    dims = P.resolve_dims(debug, 8)
    assert (dims.dp_shard, dims.tp, dims.grad_accum_steps) == (8, 1, 1)
    assert P.resolve_dims(C.load_config(["--config", str(CONFIGS / "llama3_8b.toml")]), 4).grad_accum_steps == 8
    d70 = P.resolve_dims(C.load_config(["--config", str(CONFIGS / "llama3_70b.toml")]), 64)
    assert (d70.dp_shard, d70.tp, d70.global_batch_size, d70.grad_accum_steps) == (8, 8, 32, 2)
    d405 = P.resolve_dims(C.load_config(["--config", str(CONFIGS / "llama3_405b.toml")]), 512)
    assert (d405.dp_shard, d405.tp, d405.grad_accum_steps) == (64, 8, 2)


# ----------------------------------------------------------------------------------------------
# resolve_dims()
# ----------------------------------------------------------------------------------------------


def test_resolve_dims_resolves_degrees_and_accumulation():
    cfg = C.load_config(
        [
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--training.local_batch_size",
            "4",
            "--training.global_batch_size",
            "32",
            "--training.seq_len",
            "128",
        ]
    )
    dims = P.resolve_dims(cfg, 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, dims.cp) == (2, 2, 2, 1, 1)
    assert dims.dp == 4 and dims.grad_accum_steps == 2 and dims.global_batch_size == 32
    assert dims.mesh_shape == (2, 2, 2) and dims.fsdp_enabled and dims.tp_enabled
    assert dims.tokens_per_step == 32 * 128


def test_resolve_dims_multislice_mesh():
    cfg = C.load_config(["--parallelism.num_slices", "2", "--parallelism.data_parallel_replicate_degree", "2"])
    dims = P.resolve_dims(cfg, 16)
    assert dims.mesh_shape == (2, 8, 1) and dims.dcn_mesh_shape == (2, 1, 1) and dims.ici_mesh_shape == (1, 8, 1)
    cfg = C.load_config(["--parallelism.num_slices", "2", "--parallelism.dcn_axis", "dp_shard"])
    assert P.resolve_dims(cfg, 16).ici_mesh_shape == (1, 8, 1)
    with pytest.raises(S.ConfigError, match=r"\[parallelism\] num_slices = 2 .*dcn_axis.*multiple of num_slices"):
        P.resolve_dims(C.load_config(["--parallelism.num_slices", "2"]), 16)
    # the axes dcn_axis may name (the config schema imports no torchtpu module) are the mesh's data-parallel dims
    from torchtpu.distributed.batch import DATA_PARALLEL_DIMS
    from torchtpu.distributed.mesh import JOB_MESH_DIMS

    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(S.Parallelism)}["dcn_axis"]
    assert choices == DATA_PARALLEL_DIMS and dims.mesh_axis_names == JOB_MESH_DIMS


def test_resolve_dims_checks_paths_only_when_set(tmp_path):
    cfg = C.load_config([])
    P.resolve_dims(cfg, 8)  # nothing set, nothing needed
    cfg.model.hf_assets_path = str(tmp_path)
    cfg.training.dataset_path = str(tmp_path)
    P.resolve_dims(cfg, 8)
    cfg.training.dataset_path = "gs://bucket/c4"  # remote: not checked here
    P.resolve_dims(cfg, 8)


def test_resolve_dims_rejects_bad_values_set_in_code():
    cfg = C.load_config([])
    cfg.training.steps = "10"
    with pytest.raises(S.ConfigError, match=r"\[training\] steps = \"10\".*expected an integer"):
        P.resolve_dims(cfg, 8)


def test_xla_env_updates_environment_wins():
    cfg = C.load_config(["--tpu.xla_flags", "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d"])
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    assert xla_env_updates(cfg, env) == {"XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_dump_to=/tmp/d"}
    assert xla_env_updates(cfg, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/x"}) == {}
    assert xla_env_updates(C.load_config([]), {}) == {}


# ----------------------------------------------------------------------------------------------
# Every bad input: one line on stderr naming file, section, key and value; exit 2; no traceback
# ----------------------------------------------------------------------------------------------

DEBUG = str(CONFIGS / "debug_model.toml")
BAD_INPUTS = {
    # name: (toml text or None for debug_model.toml, extra argv, substrings of the message)
    "unknown key (toml)": (
        "[training]\nseq_lenn = 256\n",
        [],
        ["bad.toml", "[training]", "seq_lenn", "256", "did you mean 'seq_len'"],
    ),
    "unknown key (cli)": (
        None,
        ["--optimizer.weight-decy", "0.1"],
        ["command line", "[optimizer]", "weight_decy", "0.1", "--optimizer.weight_decay"],
    ),
    "key in wrong section": ("[model]\nseq_len = 256\n", [], ["bad.toml", "[model]", "seq_len", "[training] seq_len"]),
    "unknown section": ("[trainig]\nsteps = 5\n", [], ["bad.toml", "[trainig]", "did you mean [training]"]),
    "torchtitan-only key": (
        '[optimizer]\nimplementation = "fused"\n',
        [],
        ["bad.toml", "[optimizer]", "implementation", "fused", "not support"],
    ),
    "wrong type (toml)": (
        '[training]\nseq_len = "long"\n',
        [],
        ["bad.toml", "[training]", "seq_len", "long", "integer"],
    ),
    "wrong type (cli)": (
        None,
        ["--training.local_batch_size", "eight"],
        ["command line", "[training]", "local_batch_size", "eight", "integer"],
    ),
    "bad bool (toml)": (
        '[checkpoint]\nenable = "yes"\n',
        [],
        ["bad.toml", "[checkpoint]", "enable", "yes", "true or false"],
    ),
    "bad choice": (
        '[lr_scheduler]\ndecay_type = "exp"\n',
        [],
        ["bad.toml", "[lr_scheduler]", "decay_type", "exp", "cosine"],
    ),
    "bad range": (None, ["--training.steps", "0"], ["command line", "[training]", "steps = 0", "> 0"]),
    "bad flavor": ('[model]\nflavor = "7B"\n', [], ["bad.toml", "[model]", "flavor", "7B", "8B"]),
    "degree product": (
        None,
        ["--parallelism.data_parallel_shard_degree", "3", "--topology", "v5e:2x4"],
        ["debug_model.toml", "[parallelism]", "data_parallel_shard_degree = 3", "8 devices"],
    ),
    "rest does not divide": (
        "[parallelism]\ntensor_parallel_degree = 3\n",
        ["--topology", "v5e:2x4"],
        ["bad.toml", "[parallelism]", "tensor_parallel_degree = 3", "8"],
    ),
    "seq_len vs tp": (
        "[parallelism]\ntensor_parallel_degree = 2\n[training]\nseq_len = 127\n",
        ["--topology", "v5e:2x4"],
        ["bad.toml", "[training]", "seq_len = 127", "multiple of 2"],
    ),
    "global batch": (
        None,
        ["--training.global_batch_size", "100", "--topology", "v5e:2x4"],
        ["debug_model.toml", "[training]", "global_batch_size = 100", "multiple of", "16"],
    ),
    "missing tokenizer": (
        '[model]\nhf_assets_path = "no/such/tokenizer"\n',
        ["--topology", "v5e:2x4"],
        ["bad.toml", "[model]", "hf_assets_path", "no/such/tokenizer", "not found"],
    ),
    "missing data": (
        None,
        ["--training.dataset_path", "/no/such/data", "--topology", "v5e:2x4"],
        ["debug_model.toml", "[training]", "dataset_path", "/no/such/data", "not found"],
    ),
    "flavor_overrides not JSON": (
        None,
        ["--model.flavor_overrides", "{dim: 64}"],
        ["command line", "[model]", "flavor_overrides", "JSON object"],
    ),
    "bad n_layers": (None, ["--model.n_layers", "0"], ["command line", "[model]", "n_layers = 0", "> 0"]),
    "bad inject_stall": (
        None,
        ["--debug.inject_stall", "1:4"],
        ["command line", "[debug]", "inject_stall", "HOST:STEP:SECONDS"],
    ),
    "bad topology": (None, ["--topology", "v5p-8"], ["command line", "[tpu]", "topology", "v5p-8", "v5p:4x4x4"]),
    "invalid toml": ("[training\nsteps = 5\n", [], ["bad.toml", "not valid TOML", "line 1"]),
    "missing file": ("", ["--config", "/no/such/config.toml"], ["/no/such/config.toml", "not found"]),
    "positional": (None, ["extra"], ["command line", "extra", "unexpected argument"]),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2(name, tmp_path, capsys):
    text, extra, needles = BAD_INPUTS[name]
    base = DEBUG if text is None else write(tmp_path, "bad.toml", text)
    status, out, err = run_cli(["--config", base, *extra], capsys)
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_model_overrides_replace_the_flavors_fields_and_name_a_field_it_lacks(tmp_path):
    """[model] n_layers and flavor_overrides change the model arguments the trainer builds (a nested
    object replaces some fields of a nested argument); a field the arguments lack is a ConfigError
    naming the file, the key and the field."""
    from torchtpu.train.model_builder import build_model_args

    moe = ["--config", str(CONFIGS / "qwen3_debug.toml"), "--model.flavor", "debugmodel_moe"]
    args = build_model_args(
        C.load_config(
            [*moe, "--model.n_layers", "3", "--model.flavor_overrides", '{"dim": 64, "moe_args": {"top_k": 2}}']
        ),
        None,
    )
    assert (args.n_layers, args.dim, args.moe_args.top_k) == (3, 64, 2)
    assert args.moe_args.num_experts == build_model_args(C.load_config(moe), None).moe_args.num_experts
    bad = write(tmp_path, "bad.toml", "[model]\nflavor_overrides = '{\"dimm\": 64}'\n")
    with pytest.raises(
        S.ConfigError, match=r"bad.toml: \[model\] flavor_overrides = .*no field 'dimm'; fields: .*dim, "
    ):
        build_model_args(C.load_config(["--config", bad]), None)


def test_config_error_inside_trainer_maps_to_exit_2(monkeypatch, capsys):
    seen = {}

    def main(cfg):
        seen["cfg"] = cfg
        P.resolve_dims(cfg, 6)  # debug_model.toml with 4-way TP cannot use 6 devices

    monkeypatch.setitem(sys.modules, "torchtpu.train.trainer", types.SimpleNamespace(main=main))
    status, out, err = run_cli(["--config", DEBUG, "--parallelism.tensor_parallel_degree", "4"], capsys)
    assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "tensor_parallel_degree = 4 (command line)" in err and "6 devices" in err
    assert isinstance(seen["cfg"], S.JobConfig)
    status, out, err = run_cli(["--config", DEBUG, "--parallelism.tensor_parallel_degree", "4", "--debug"], capsys)
    assert status == 2 and "Traceback" in err


def test_trainer_receives_config_and_its_status(monkeypatch, capsys):
    got = []
    monkeypatch.setitem(
        sys.modules, "torchtpu.train.trainer", types.SimpleNamespace(main=lambda cfg: got.append(cfg) or 0)
    )
    status, out, err = run_cli(["--config", DEBUG, "--training.steps", "3", "--dry-run"], capsys)
    assert status == 0 and err == ""
    assert got[0].training.steps == 3 and got[0].tpu.dry_run is True


def test_missing_trainer_is_a_clear_one_line_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchtpu.train.trainer", None)
    status, out, err = run_cli(["--config", DEBUG], capsys)
    assert status == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "torchtpu.train.trainer" in err


def test_schema_is_dataclasses():
    cfg = S.JobConfig()
    assert dataclasses.is_dataclass(cfg) and dataclasses.is_dataclass(cfg.training.dataloader)
    assert [f.name for f in dataclasses.fields(cfg)] == [
        "job",
        "profiling",
        "metrics",
        "model",
        "optimizer",
        "lr_scheduler",
        "training",
        "parallelism",
        "checkpoint",
        "activation_checkpoint",
        "compile",
        "comm",
        "validation",
        "debug",
        "tpu",
        "experimental",
    ]
