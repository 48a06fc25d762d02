# The README's commands. `make install` once, then `make up` or `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install up demo test bench bench-codec bench-pipeline bench-sampler

install:
	bash install.sh

up:
	$(VENV)/bin/fleetscope up

demo: up

test:
	$(VENV)/bin/pytest -q

bench: bench-codec bench-pipeline bench-sampler

bench-codec:
	$(PY) benchmarks/codec_bench.py

bench-pipeline:
	$(PY) benchmarks/pipeline_bench.py

bench-sampler:
	$(PY) benchmarks/sampler_cost_bench.py
