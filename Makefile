# Every target installs what it needs. torch: the CPU build (2.13.0) is installed only when no
# torch is importable; an existing torch (CUDA or CPU) is never replaced.
PYTHON ?= python3
PIP := $(PYTHON) -m pip --disable-pip-version-check
TORCH_CPU := torch==2.13.0
QUICKSTART_DIR ?= runs/quickstart

.PHONY: help torch install install-quickstart install-test test quickstart bench clean

help:
	@echo "make test        install test dependencies, build the C++ extension, run the suite"
	@echo "make quickstart  train a tokenizer and the tiny model on Python's documentation text (CPU, minutes)"
	@echo "make bench       run the benchmarks in benchmarks/"

torch:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_CPU)

install: torch
	$(PIP) install -q "setuptools>=68" wheel "pybind11>=2.12"
	$(PIP) install -q --no-build-isolation -e .

install-quickstart: torch
	$(PIP) install -q "setuptools>=68" wheel "pybind11>=2.12"
	$(PIP) install -q --no-build-isolation -e ".[quickstart]"

install-test: torch
	$(PIP) install -q "setuptools>=68" wheel "pybind11>=2.12"
	$(PIP) install -q --no-build-isolation -e ".[test]"

test: install-test
	$(PYTHON) -m pytest -q -n 2 --dist loadgroup --durations=15 tests

quickstart: install-quickstart
	PYTHON=$(PYTHON) bash examples/quickstart.sh $(QUICKSTART_DIR)

bench: install-test
	$(PYTHON) benchmarks/bench_preprocess.py
	$(PYTHON) benchmarks/bench_packing.py
	$(PYTHON) benchmarks/bench_attention.py
	$(PYTHON) benchmarks/bench_loss.py
	$(PYTHON) benchmarks/bench_recipe_plan.py
	$(PYTHON) benchmarks/bench_parallel.py
	$(PYTHON) benchmarks/bench_moe_overlap.py
	$(PYTHON) benchmarks/bench_cpu_step.py
	$(PYTHON) benchmarks/bench_optim.py
	$(PYTHON) benchmarks/bench_gpu.py --tiny

clean:
	rm -rf build *.egg-info data/_csrc*.so $(QUICKSTART_DIR)
