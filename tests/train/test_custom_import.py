"""`[experimental] custom_import`: the user's own module, imported while the configuration is read, registers
a model family whose norms run the user's JAX function with a hand-written gradient as a torch op
(torchtpu.jax_op); the Trainer `torchtpu-train` runs trains it under FSDP over the 8 devices with the losses of plain
PyTorch on CPU running nn.RMSNorm (the reference op). Bad values are one-line errors."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from torchtpu.models.registry import get_family
from torchtpu.train.config.job_config import ConfigError
from torchtpu.train.config.manager import load_config

from .debug_run import DEBUG_TOML
from .reference import cpu_state, reference_run

pytestmark = pytest.mark.usefixtures("keep_current_mesh")


@pytest.fixture(autouse=True)
def registered_families_restored():
    """The families a test's custom import registers leave the registry with the test, so the tests
    that walk every family after it in this process see the built-in ones."""
    from torchtpu.models import registry

    before = dict(registry.FAMILIES)
    yield
    registry.FAMILIES.clear()
    registry.FAMILIES.update(before)


USER_MODULE = os.path.join(os.path.dirname(__file__), "user_code", "my_norm.py")
STEPS = 6


def _argv(tmp_path, *extra):
    return [
        "--config", DEBUG_TOML,
        "--job.dump_folder", str(tmp_path),
        "--model.n_layers", "2",
        "--training.seq_len", "32",
        "--training.local_batch_size", "1",
        "--training.steps", str(STEPS),
        "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1",
        "--validation.enable", "false",
        *extra,
    ]  # fmt: skip


def test_a_users_op_trains_under_fsdp_with_the_reference_ops_losses(tmp_path):
    from torchtpu.train.trainer import Trainer

    cfg = load_config(_argv(tmp_path, "--experimental.custom_import", USER_MODULE, "--model.name", "llama3_my_norm"))
    my_norm = sys.modules["my_norm"]
    family = get_family("llama3_my_norm")
    assert not family.has_hf_weights()  # no folder in torchtpu.models: no Hugging Face weights, no error
    t = Trainer(cfg)
    assert t.dims.dp_shard == 8
    assert sum(type(m) is my_norm.MyRMSNorm for m in t.model.modules()) == 2 * 2 + 1
    init = cpu_state(t.model)
    got = [h["loss"] for h in t.train()]
    assert "forward" in my_norm.TRACED and "backward" in my_norm.TRACED  # the op and its own gradient ran
    reference = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name="llama3"))
    ref, _ = reference_run(reference, init, STEPS)
    rel = max(abs(g - r) / abs(r) for g, r in zip(got, ref))
    print(f"trainer {got}\nCPU     {ref}\nmax relative difference {rel:.2e}")
    assert rel <= 1e-5, (got, ref)  # 7e-8 measured; a wrong input gradient in the norm gives 2e-4
    assert min(ref[-2:]) < ref[0] - 0.1  # it learns: not two flat curves


def test_a_module_by_name_from_the_working_directory(tmp_path, monkeypatch):
    """A dotted name is found in the working directory, as `python -m` finds it, and its family is a
    [model] name; the saved configuration names the module for a resume."""
    (tmp_path / "my_family.py").write_text(
        "import dataclasses\n"
        "from torchtpu.models.registry import get_family, register_family\n"
        'register_family(dataclasses.replace(get_family("llama3"), name="llama3_mine", flavors=("tiny",)))\n'
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_family", raising=False)
    toml = tmp_path / "job.toml"
    toml.write_text('[model]\nname = "llama3_mine"\nflavor = "tiny"\n\n[experimental]\ncustom_import = "my_family"\n')
    cfg = load_config(["--config", str(toml)])
    assert (cfg.model.name, cfg.model.flavor, cfg.experimental.custom_import) == ("llama3_mine", "tiny", "my_family")
    assert 'custom_import = "my_family"' in cfg.to_toml()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--experimental.custom_import", "no_such_module_here"], "no module 'no_such_module_here' in the working"),
        (["--experimental.custom_import", "missing/my_kernels.py"], "no such file"),
        (["--experimental.custom_import", "my-kernels"], "not a module name"),
        (["--model.name", "llama3_unregistered"], "or a family that [experimental] custom_import registers"),
    ],
    ids=["module", "file", "name", "family"],
)
def test_bad_values_are_one_line_errors(tmp_path, extra, message):
    with pytest.raises(ConfigError) as e:
        load_config(_argv(tmp_path, *extra))
    text = str(e.value)
    assert message in text and "\n" not in text, text


def test_registering_another_family_under_a_taken_name_is_refused():
    from torchtpu.models.registry import get_family, register_family

    llama = get_family("llama3")
    assert register_family(llama) is llama  # the same definition again: a module imported twice
    with pytest.raises(ValueError, match="'llama3' is already registered"):
        register_family(dataclasses.replace(llama, preparer="my_norm:use_my_norm"))
    with pytest.raises(ValueError, match="must be a 'module:attribute' string"):
        register_family(dataclasses.replace(llama, name="llama3_bad", preparer="use_my_norm"))
