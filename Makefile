# Newcomer targets: `make train` (set up + main job) and `make test` (set up + every test); `make test-fast`: the unit
# tier only (tests/conftest.py sorts the tests into tiers).
# Every install uses constraints.txt, which pins torch==2.13.0 (an unpinned torch pulls CUDA packages).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: venv test test-fast lint typecheck train plan clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(BIN)/python -m pytest -n 2 --dist loadfile

test-fast: venv
	$(BIN)/python -m pytest -n 2 --dist loadfile -m unit

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/python tools/typecheck.py

train: venv
	$(BIN)/shardflow train --strategy tp --nproc 2

plan: venv
	$(BIN)/shardflow plan --model gpt --strategy tp --nproc 2

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache
