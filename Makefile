# Two entry points do everything on a fresh machine:
#   make train [ARGS="hydra overrides"]   set up the environment, then train the default model
#   make test                             set up the environment, then run the whole test suite
# The environment is refreshed whenever pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch that lies on these machines; an unpinned torch pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
ARGS   ?=

.PHONY: env train test lint sweep clean

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" -e ".[experiments,test]"
	touch $@

train: env
	$(PY) experiments/train.py $(ARGS)

test: env
	$(PY) -m pytest $(ARGS)

# also run by the suite (tests/test_lint.py, tests/test_layers.py)
lint: env
	$(PY) -m ruff check .
	$(PY) -m mypy

clean:
	rm -rf $(VENV) outputs multirun
