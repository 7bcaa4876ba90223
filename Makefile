VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install lint test bench train clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,tpu]'
	touch $(STAMP)

install: $(STAMP)

# Architecture (import-linter contracts), lint, format and dead code; configured in pyproject.toml.
# Then the documents: no history wording, README.md's length (tests/docs_lint.py says the rules).
lint: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/vulture
	$(PY) -m tests.docs_lint

test: lint
	$(PY) -m pytest -n 2 --dist loadgroup -p no:cacheprovider --durations=30 tests

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
