# Two commands for a fresh machine:  `make run`  (set up + main job)   `make test`  (set up + tests)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tidal-installed

.PHONY: setup run run-hf simulate test test-fast bench clean-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is a CPU build on disk here; anything else pulls CUDA.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,postgres,math,trackers,gguf]'
	touch $(STAMP)

setup: $(STAMP)

# Main job: train the tiny LM on CPU, lending the trainer's core to rollout when the policy says it pays (a Prefect
# flow run per step over Ray actors); the run lands in runs/ (store, checkpoints, report, plots).
run: $(STAMP)
	$(VENV)/bin/tidal run tiny-cpu

# A tiny Hugging Face model (Qwen2 architecture, BPE tokenizer trained in code) on verl-schema
# parquet; the first run builds both into runs/tiny-hf/.
run-hf: $(STAMP)
	$(VENV)/bin/tidal run tiny-hf

# The simulator on the seed's 32-GPU preset, every static split against the dynamic setups.
simulate: $(STAMP)
	$(VENV)/bin/tidal simulate sim/qwen35-35b-dynamic --compare --json runs/sim/result.json --plot runs/sim

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# Every benchmark, one after the other (~1 h on 2 cores; results: benchmarks/RESULTS.md and
# benchmarks/results.json). `make bench ONLY=compare,faults` runs a subset.
bench: $(STAMP)
	$(PY) benchmarks/run_all.py $(if $(ONLY),--only $(ONLY),)

clean-venv:
	rm -rf $(VENV)
