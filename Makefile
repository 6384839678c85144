# rloo-service. `make demo` and `make test` install what they need into .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch on machines without a GPU; GPU hosts: `make install CONSTRAINTS=`.
CONSTRAINTS ?= .ci/constraints.txt
PIP_CONSTRAINT_FLAG := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
STAMP := $(VENV)/.installed
PORT ?= 8000

.PHONY: install system-packages demo up test test-fast bench bench-learning soak gpu-check tinker-venv tinker-examples lint clean

install: $(STAMP) system-packages

# bubblewrap (the python graders' sandbox) and chromium (the dashboard's tests): Debian's packages;
# .ci/system-packages says what it does.
system-packages:
	@.ci/system-packages

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(PIP_CONSTRAINT_FLAG) -e '.[worker,dev]'
	touch $(STAMP)

demo: install
	$(BIN)/rloo demo --port $(PORT)

up: install
	$(BIN)/rloo up --port $(PORT)

# Three processes, each stealing the next test from the others when it runs out: most e2e tests wait
# on child processes, so on two cores two processes left a third of the CPU idle (the suite took
# 18 min with two, 15 with three when measured; 20-23 min with three on 2026-12-07's machines, where
# the CPUs were busy 1.7 of 2 cores throughout: TEST_PROCESSES=2 where a test's time matters more).
TEST_PROCESSES ?= 3
test: install
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist worksteal $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -m "not e2e" $(PYTEST_ARGS)

BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q $(PIP_CONSTRAINT_FLAG) -e '.[worker,dev,bench]'
	touch $(BENCH_STAMP)

# Figures, not pass/fail: the engine alone, then against TRL's RLOOTrainer (benchmarks/RESULTS.md keeps them).
bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.run
	$(BIN)/python -m benchmarks.anchor
	$(BIN)/python -m benchmarks.anchor --reward-model --rounds=3
	$(BIN)/python -m benchmarks.busy

# The advantage estimators over learning rates, the loss aggregations, drop_constant_groups and a
# noise floor on two tasks a tiny model learns (examples/addition: exact and graded reward), 10 seeds
# an arm, scored without sampling noise; gradients at fixed weights; TRL's RLOOTrainer checked number
# by number. Figures on stdout and in benchmarks/learning.json, benchmarks/learning.png drawn (about
# 90 minutes on 2 cores; finished runs are kept in var/bench-learning, so a rerun goes on from there).
bench-learning: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.learning

# The chaos soak: two API processes, two training workers, a graders and an inference worker,
# PostgreSQL (through a proxy it cuts) and a Redis of its own (killed and started again), three
# projects' clients, a seeded fault every 6-15 s for SOAK_MINUTES; then its checks (every job ended,
# each step once, checkpoints load, one worker at a time, nothing orphaned, one job per
# Idempotency-Key, usage metered, every request answered). Figures on stdout; exit 1 on a problem.
# Needs PostgreSQL (TEST_DATABASE_URL, or postgres@127.0.0.1:5432). Loopback only.
SOAK_MINUTES ?= 5
SOAK_SEED ?= 1
soak: install
	$(BIN)/python -m benchmarks.soak --minutes $(SOAK_MINUTES) --seed $(SOAK_SEED)

# A GPU host's figures, unattended in under 10 minutes: a random-weight model of Qwen2.5-0.5B's shape
# trains RLOO a few steps on 1 GPU (transformers, then vLLM where it is installed) and on all GPUs;
# generated tokens/s, the step split, MFU, peak memory and the memory plan's error, on stdout and in
# benchmarks/gpu_check.json and .md (GPU_CHECK_ARGS: e.g. --out DIR). Needs torch's CUDA build: the
# install must skip the CPU pin, `make gpu-check CONSTRAINTS=` (in a venv made that way: a fresh
# checkout, or VENV=.venv-gpu beside a CPU one). Without a GPU it says so and exits 0; CI never runs it.
gpu-check: $(STAMP)
	$(BIN)/python -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

# tinker-cookbook's own loops against a running stack (`make up` first): its venv beside ours, since
# tinker-cookbook 0.5.8 pins an older transformers; then sl_loop and math_rl (examples/tinker/run.py).
TINKER_VENV ?= .venv-tinker
TINKER_STAMP := $(TINKER_VENV)/.installed

$(TINKER_STAMP): $(CONSTRAINTS)
	test -x $(TINKER_VENV)/bin/python || $(PYTHON) -m venv $(TINKER_VENV)
	$(TINKER_VENV)/bin/python -m pip install -q --upgrade pip
	$(TINKER_VENV)/bin/python -m pip install -q $(PIP_CONSTRAINT_FLAG) tinker==0.38.0 'tinker-cookbook[math-rl]==0.5.8'
	touch $(TINKER_STAMP)

tinker-venv: $(TINKER_STAMP)

tinker-examples: install $(TINKER_STAMP)
	$(BIN)/python examples/tinker/run.py

lint: install
	$(BIN)/ruff check service worker tests benchmarks migrations examples
	$(BIN)/ruff format --check service worker tests benchmarks migrations examples
	$(BIN)/mypy service worker

clean:
	rm -rf var .pytest_cache .mypy_cache .ruff_cache
