# The README's commands. `make install` once, then `make demo`, `make up` or `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install up demo test bench bench-codec bench-pipeline bench-sampler bench-probes bench-torch \
        bench-ddp-overhead bench-model bench-scoring bench-scenarios chaos images-local

install:
	bash install.sh

up:
	$(VENV)/bin/fleetscope up

# A few minutes, no configuration: a real 2-rank training job, one injected fault, what was detected vs the truth.
demo:
	$(VENV)/bin/fleetscope demo

test:
	$(VENV)/bin/pytest -q

bench: bench-codec bench-pipeline bench-sampler bench-probes bench-torch bench-model bench-scoring bench-scenarios

bench-codec:
	$(PY) benchmarks/codec_bench.py

bench-pipeline:
	$(PY) benchmarks/pipeline_bench.py

bench-sampler:
	$(PY) benchmarks/sampler_cost_bench.py

# the eBPF ones load BPF programs: run as root
bench-probes:
	$(PY) benchmarks/probe_cost_bench.py

bench-torch:
	$(PY) benchmarks/torch_overhead_bench.py

# 10-13 minutes: a 2-rank DDP job with no agent, a sampling agent, and a tracing agent, interleaved
bench-ddp-overhead:
	$(PY) benchmarks/ddp_overhead_bench.py

bench-model:
	$(PY) benchmarks/model_bench.py

bench-scoring:
	$(PY) benchmarks/scoring_bench.py

bench-scenarios:
	$(VENV)/bin/fleetscope bench scenario benchmarks/scenarios/dev benchmarks/scenarios/test --repeats 3 --out benchmarks/results

# 20-40 minutes: the chaos suite's long form (30 s broker pause, 60 s store outage, 10 worker kills, 3 sink
# kills, a worker joining and leaving, 10^5 malformed messages) against the real embedded stack;
# its short form runs with `make test`. Writes benchmarks/results/chaos.json, failed cases included.
chaos:
	rm -f benchmarks/results/chaos.json
	FLEETSCOPE_CHAOS=long FLEETSCOPE_CHAOS_OUT=benchmarks/results/chaos.json $(VENV)/bin/pytest -q tests/test_chaos.py

# Both images with Debian's podman from a base made here with debootstrap, no registry; root (README, Images)
images-local:  # root builds directly; anyone else through sudo
	$(if $(filter 0,$(shell id -u)),,sudo) bash deploy/images/build-local.sh
