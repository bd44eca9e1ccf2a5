# The README's two commands: `make demo` and `make test`. Both build .venv from pinned versions:
# the demo only what the trainer needs, the tests the dev extra on top.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TRAINER := $(VENV)/.installed-trainer
INSTALLED := $(VENV)/.installed
OPS := $(VENV)/.installed-ops
# checkov, which checks the chart's pods for a NetworkPolicy (CKV2_K8S_6), in a venv of its own:
# its pins conflict with the project's (with constraints.txt pip would take checkov 2.0)
CHECKOV := $(VENV)/checkov/bin/checkov
CHECKOV_VERSION := 3.3.30
# what the integration tests run besides Python, as COMMAND:DEBIAN_PACKAGE: Prometheus server
# and promtool, kubectl for `kubectl kustomize`, unshare for ddp-ops local's pod sandboxes, and
# nsenter, setpriv, ip and iptables for its pod network and the job's NetworkPolicy there;
# and what the image targets run: a container engine, mmdebstrap for the stand-in base.
# tests/debian-tools.sh installs what is missing as root, or names it in one line
TEST_TOOLS := prometheus:prometheus promtool:prometheus kubectl:kubernetes-client unshare:util-linux \
	nsenter:util-linux setpriv:util-linux ip:iproute2 iptables:iptables
IMAGE_TOOLS := dockerd:docker.io mmdebstrap:mmdebstrap
# torchrun's restarts reuse no rendezvous store port: without it, 3 of 7 kill-and-restart
# trials under --standalone hung or failed to connect (docs/facts.md, "the rendezvous store")
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE := 1

.PHONY: demo ops test test-quick device-check device-wheels image image-e2e lint tools image-tools clean

# the first install says what it fetches, and pip shows each package as it comes (docs/running.md)
$(TRAINER): pyproject.toml constraints.txt
	@echo "make: installing the trainer's pinned dependencies into $(VENV), once: torch (CPU build), numpy,"
	@echo "make: scikit-learn (the demo's digits), boto3 (S3), pydantic and a few more"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check --progress-bar on -c constraints.txt -e .
	touch $@

$(INSTALLED): $(TRAINER)
	@echo "make: installing the test tools into $(VENV), once: pytest, moto, Lightning, Helm's engine, ..."
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $@

$(CHECKOV): $(TRAINER)
	$(PYTHON) -m venv $(VENV)/checkov
	$(VENV)/checkov/bin/pip install --quiet --disable-pip-version-check checkov==$(CHECKOV_VERSION)

$(OPS): $(TRAINER)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[ops]'
	touch $@

## ops: Helm's engine (244 MB) in the demo's .venv, for ddp-ops render, submit and local
ops: $(OPS)

## demo: a 2-process CPU DDP run on the bundled digits data, checkpoints in ./checkpoints/digits-cnn
demo: $(TRAINER)
	$(BIN)/ddp-launch -- --standalone --nproc_per_node=2 -m trainer --config digits

## test: lint, then the whole suite (real torchrun processes on loopback), side by side where
## it is safe, then the tests that need the machine to themselves; its last line is its wall
## time against its 15-minute budget (tests/suite.sh), failing past 1.5 times it
test: $(INSTALLED) $(CHECKOV) tools lint
	@sh tests/suite.sh $(BIN)/pytest

## test-quick: everything but the multi-process runs marked slow
test-quick: $(INSTALLED) $(CHECKOV) tools lint
	$(BIN)/pytest -m "not slow and not image"

tools:
	@sh tests/debian-tools.sh "make test" $(TEST_TOOLS)

image-tools:
	@sh tests/debian-tools.sh "make image" $(IMAGE_TOOLS)

## device-check: on a lent GPU machine, from a bare checkout with its own python3 and torch (no
## venv, no network): the wheels of .whl/ (`make device-wheels`, here) to /tmp/site, then the
## check, its report in $$OUT/device-report.md where the device tool sets OUT; without CUDA, the CPU path
device-check:
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
	PYTHONPATH=/tmp/site:. python3 -m benchmarks.device_check --out $${OUT:-.}/device-report.md

## device-wheels: what the lent machine's python3 (3.12) lacks for the trainer, as wheels in .whl/,
## at constraints.txt's versions (its own has torch, numpy, yaml, prometheus-client, psutil, tqdm, ...)
DEVICE_WHEELS = pydantic pydantic_core annotated-types typing-inspection typing_extensions xxhash
device-wheels: $(INSTALLED)
	rm -rf .whl
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		$$(for name in $(DEVICE_WHEELS); do grep -i "^$$name==" constraints.txt; done)
	@du -sh .whl

## image: the CUDA image, tagged as the chart's image; starts a private dockerd when none answers
## and builds on a stand-in base when no registry does (README, "The image")
image: $(INSTALLED) image-tools
	$(BIN)/python -m operator_scripts.image.build

## image-e2e: the chart's CPU job as containers of that image (ddp-ops local --runtime docker):
## Succeeded, a SIGKILLed pod resumed, a metrics scrape, rank 0's docker logs; and a code change's layers
image-e2e: $(INSTALLED) image-tools
	$(BIN)/python -m operator_scripts.image.engine -- $(BIN)/pytest -m image -p no:cacheprovider -s tests/test_image_e2e.py

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) checkpoints .pytest_cache .ruff_cache *.egg-info
