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
# test workers (pytest-xdist); each module runs on one, the modules with slow tests first
WORKERS ?= 2

.PHONY: env train test lint sweep clean device-wheels gpu-check

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)" -e ".[experiments,test]"
	touch $@

# the default model offloaded to host memory and NVMe files (conf/experiment/offload_cpu.yaml);
# EXPERIMENT= (empty) runs the plain default job, whose budgets are all free memory; an experiment= in ARGS wins
EXPERIMENT ?= offload_cpu
train: env
	$(PY) experiments/train.py $(if $(and $(EXPERIMENT),$(if $(findstring experiment=,$(ARGS)),,x)),experiment=$(EXPERIMENT)) $(ARGS)

test: env
	$(PY) -m pytest -n $(WORKERS) --dist loadfile $(ARGS)

# also run by the suite (tests/test_lint.py, tests/test_layers.py)
lint: env
	$(PY) -m ruff check .
	$(PY) -m mypy

# The wheels a GPU machine's image lacks (it has torch, lightning, transformers and psutil), for
# CPython 3.12 on x86-64 Linux, into .whl/ (ignored by git, carried with the checkout); those
# published only as source are built into wheels here (DeepSpeed with its native ops left to
# compile on the GPU machine, where nvcc and ninja are).
WHEELS   ?= .whl
DEVICE_PY ?= 3.12
device-wheels: env
	mkdir -p $(WHEELS)
	$(PY) -m pip wheel --quiet --no-deps -w $(WHEELS) "antlr4-python3-runtime==4.9.3"
	DS_BUILD_OPS=0 $(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w $(WHEELS) "deepspeed==0.19.8"
	$(PY) -m pip download --quiet --only-binary=:all: --python-version $(DEVICE_PY) --implementation cp \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
	  --find-links $(WHEELS) -d $(WHEELS) "hydra-core==1.3.8" "omegaconf==2.3.1" "wandb==0.31.0" "antlr4-python3-runtime==4.9.3"
	# their other needs (torch, numpy, einops, ...) are in the image: without them, not a CUDA torch of several GB
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(DEVICE_PY) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform any --find-links $(WHEELS) -d $(WHEELS) "hjson==3.1.0" "torchao==0.18.0"

# On a GPU machine, with the system's Python (no virtual environment is made there): docs/gpu.md.
# PART: all (tests, probe and bench), tests, probe, bench, race, timeline, memory, peers-a or
# peers-b, each at most five minutes on an H100/H200 (all: eight); one device call each.
OUT  ?= gpu-check
PART ?= all
gpu-check:
	bash tools/gpu_check.sh $(OUT) $(PART)

clean:
	rm -rf $(VENV) outputs multirun
