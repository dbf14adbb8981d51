# Local virtualenv in .venv; torch==2.13.0 goes in first so CPU machines get the CPU wheel.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The main job: the kernel demo, then a zero-mismatch RL run next to a kernel-swapped one.
demo: $(STAMP)
	$(BIN)/python -m bik demo
	rm -rf runs/zero_mismatch runs/kernel_swap
	$(BIN)/python -m rl_harness run --out runs/zero_mismatch
	$(BIN)/python -m rl_harness run --recipe kernel_swap --out runs/kernel_swap
	$(BIN)/python -m rl_harness compare runs/zero_mismatch runs/kernel_swap --out runs/compare

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .cache runs
