# The README's two commands: `make demo` and `make test`. Both build .venv from pinned versions.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
# torchrun's restarts reuse no rendezvous store port: without it, 3 of 7 kill-and-restart
# trials under --standalone hung or failed to connect (shared/reference/FACTS.md)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE := 1

.PHONY: demo test test-quick gpu-check lint clean

$(INSTALLED): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $@

## demo: a 2-process CPU DDP run on the bundled digits data, checkpoints in ./checkpoints/digits
demo: $(INSTALLED)
	$(BIN)/ddp-launch -- --standalone --nproc_per_node=2 -m trainer --config digits

## test: lint, then the whole suite (real torchrun processes on loopback)
test: $(INSTALLED) lint
	$(BIN)/pytest

## test-quick: everything but the multi-process runs marked slow
test-quick: $(INSTALLED) lint
	$(BIN)/pytest -m "not slow"

## gpu-check: on a machine with GPUs, the gpu tests, 1-GPU and all-GPU nccl/bf16 runs, bench_gpu
## and a report; without CUDA, the CPU part and a line saying so
gpu-check: $(INSTALLED)
	$(BIN)/python -m operator_scripts.gpu_check

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) checkpoints .pytest_cache .ruff_cache *.egg-info
