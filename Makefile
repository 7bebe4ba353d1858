# rollmesh: `make demo` and `make test` work on a fresh machine. The first run creates .venv,
# installs torch (pinned, CPU build here) first so pip never pulls a different one for the
# project, then the project with its test extras; a stamp file skips all that afterwards.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0

PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: demo test schemas install sandbox-tools browser-tools

demo: install
	RAY_AUTH_MODE=disabled $(BIN)/rollmesh demo $(DEMO_ARGS)

test: install
	RAY_AUTH_MODE=disabled $(BIN)/python -m pytest --durations=20 -p no:cacheprovider $(PYTEST_ARGS)

schemas: install
	$(BIN)/python scripts/generate_schemas.py

install: $(STAMP) sandbox-tools browser-tools

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install torch==$(TORCH_VERSION)
	$(BIN)/pip install -e '.[test]'
	touch $@

# bubblewrap isolates tool code; without it the sandbox falls back to the process backend, which
# isolates nothing. Installed only when we are root and apt-get exists; never fails the build.
sandbox-tools:
	@if ! command -v bwrap >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing bubblewrap"; \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) \
				|| echo "warning: could not install bubblewrap; sandboxes will not isolate tool code"; \
		else \
			echo "warning: bwrap not found (install bubblewrap); sandboxes will not isolate tool code"; \
		fi; \
	fi

# The dashboard's browser test drives the system Chromium through playwright (never
# `playwright install`). Installed only when we are root and apt-get exists; never fails the build
# (the test then fails saying what is missing).
browser-tools:
	@if ! command -v chromium >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing chromium"; \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
				|| echo "warning: could not install chromium; the dashboard's browser test will fail"; \
		else \
			echo "warning: chromium not found (install it); the dashboard's browser test will fail"; \
		fi; \
	fi
