# hf_ppo developer commands. `make demo` and `make test` install what they need first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .make/installed

# On a machine that ships a local CPU torch wheel (CI, the dev boxes) pin that wheel, so that
# resolving `torch` never pulls the CUDA packages; elsewhere pip installs torch as usual.
CPU_WHEEL := $(firstword $(wildcard /opt/wheels/torch-*+cpu-*.whl))
TORCH_REQ := $(if $(CPU_WHEEL),torch==$(word 2,$(subst -, ,$(notdir $(CPU_WHEEL)))),torch)

.PHONY: install demo test test-fast bench bench-gpu clean

$(STAMP): pyproject.toml
	@mkdir -p .make
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "$(subst +cpu,,$(TORCH_REQ))"
	$(PIP) install -q -e ".[test]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PYTHON) recipes/demo.py --output_dir outputs/demo

test: $(STAMP)
	$(PYTHON) -m pytest -q tests

test-fast: $(STAMP)
	$(PYTHON) -m pytest -q -m "not slow" tests

bench: $(STAMP)
	$(PYTHON) bench/bench.py

bench-gpu: $(STAMP)
	$(PYTHON) bench/bench.py --gpu

clean:
	rm -rf .make outputs build *.egg-info
