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

# The embedded default (builtin engine, zoo:hybrid, zoo:oracle) audited clean, then the same with the
# seed's 32-bit offset overflow re-created (offset-wrap) so the report has lies to show.
demo: $(STAMP)
	@stamp=$$(date +%Y%m%d-%H%M%S); \
	$(VENV)/bin/lpf audit --out runs/demo-$$stamp-clean && \
	$(VENV)/bin/lpf audit --out runs/demo-$$stamp-offset-wrap --inject offset-wrap:18 --cache-mb 4 --fail-on never && \
	echo "results: runs/demo-$$stamp-clean and runs/demo-$$stamp-offset-wrap (findings.json, lpf query DIR \"SQL\")"

# One intra-op thread: the suite starts many small-model processes one after another, where extra
# threads only add overhead (and oversubscribe a busy machine); numerics do not depend on it.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/python bench/rescore.py
	$(VENV)/bin/python bench/engine.py

clean:
	rm -rf $(VENV) runs .pytest_cache
