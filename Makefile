# `make demo` and `make test` each do all set-up on a fresh machine: create .venv, install, run.
# The venv is reused until pyproject.toml or the constraints file changes.
# GPU users: `make CONSTRAINTS=constraints-none.txt test` (no torch pin; bring your own CUDA torch).
PY ?= python3
VENV := .venv
CONSTRAINTS ?= constraints-cpu.txt
STAMP := $(VENV)/.installed-$(notdir $(CONSTRAINTS))
PYTEST_ARGS ?=

.PHONY: venv demo test bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q -c $(CONSTRAINTS) -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lpf audit --out runs/demo-$$(date +%Y%m%d-%H%M%S) --max-tokens 16

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/python bench/rescore.py

clean:
	rm -rf $(VENV) runs .pytest_cache
