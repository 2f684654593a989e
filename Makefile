# bcg: the usual entry points. `make install render` renders the example job on a laptop CPU.
PYTHON ?= python3
TORCH ?= torch==2.13.0

.PHONY: install test test-fast render plan bench bench-fast bench-quick capture gpu-test

install:
	$(PYTHON) -m pip install "$(TORCH)" -e '.[test]'

test:
	$(PYTHON) -m pytest -q

# Without the tests that start processes (torchrun, kill -9, signals) or build compiled kernels: 1314 of the 1517
# tests (2026-12-02), in about 70-150 s on two cores.
test-fast:
	$(PYTHON) -m pytest -q -m "not slow and not gpu"

render:
	bcg render jobs/episode1.yaml

plan:
	bcg plan jobs/episode1.yaml

# On a CUDA machine, sdxl-random weights: (a) diffusers, (b) diffusers + torch.compile (compiles per
# shape: expect many minutes), (c) bcg cold, (d) bcg after capture, microbenchmarks.
bench:
	bcg bench jobs/bench.yaml --with-compile

# The same without (b).
bench-fast:
	bcg bench jobs/bench.yaml

bench-quick:
	bcg bench jobs/bench.yaml --quick

capture:
	bcg capture --warm

# Every test marked gpu (graph replay vs eager, in-place weight updates, the out-of-memory split).
gpu-test:
	$(PYTHON) -m pytest -q -m gpu
