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
	$(BIN)/rollmesh demo $(DEMO_ARGS)

test: install
	$(BIN)/python -m pytest --durations=20 -p no:cacheprovider $(PYTEST_ARGS)

schemas: install
	$(BIN)/python scripts/generate_schemas.py

install: $(STAMP) sandbox-tools browser-tools

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install torch==$(TORCH_VERSION)
	$(BIN)/pip install -e '.[test]'
	touch $@

# System tools, installed only where missing, when we are root and apt-get exists; never fails the
# build. bubblewrap isolates tool code (without it the sandbox falls back to the process backend,
# which isolates nothing); chromium runs the dashboard's browser test through playwright (never
# `playwright install`; without it that test fails saying what is missing).
# $(call apt_install_missing,COMMAND,PACKAGE,WHAT GOES WRONG WITHOUT IT)
define apt_install_missing
	@if ! command -v $(1) >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing $(2)"; \
			(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2)) \
				|| echo "warning: could not install $(2); $(3)"; \
		else \
			echo "warning: $(1) not found (install $(2)); $(3)"; \
		fi; \
	fi
endef

sandbox-tools:
	$(call apt_install_missing,bwrap,bubblewrap,sandboxes will not isolate tool code)

browser-tools:
	$(call apt_install_missing,chromium,chromium,the dashboard's browser test will fail)

# Wheels for the sandbox image test (tests/test_sandbox_images.py), fetched once so nothing is
# downloaded while tests run: numpy and ase, pinned, for the host's python3 (what that test's
# environment is built with; sandbox roots default to the host). ase without its declared
# scipy and matplotlib (~50 MB more), which `import ase` does not need.
WHEELHOUSE := $(VENV)/wheelhouse
SANDBOX_TEST_WHEELS := numpy==2.4.6 ase==3.29.0

.PHONY: wheelhouse
test: wheelhouse
wheelhouse: $(WHEELHOUSE)/.complete

$(WHEELHOUSE)/.complete: | $(BIN)/python
	$(BIN)/python -m pip download --no-deps --only-binary=:all: -d $(WHEELHOUSE) \
		--python-version "$$(/usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
		$(SANDBOX_TEST_WHEELS)
	touch $@
