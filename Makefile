# tokentrace: `make demo` traces the sample server end to end; `make test` runs the
# whole suite. Both set the machine up first (apt: BCC, kernel headers; pip: a venv).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup host venv demo test bench clean

setup: host venv

host:
	bash deploy/setup-host.sh

# The venv: torch pinned to the CPU wheel this machine carries (a bare `torch` would
# pull a multi-GB CUDA build), then the project with its test extras, then Debian's
# BCC linked in (the PyPI package named `bcc` is unrelated: never install it).
venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0 \
	  || $(BIN)/python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(BIN)/python -m pip install -q -e '.[test]'
	# Resolved when the recipe runs: the venv does not exist when make parses this file.
	site=$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
	  && test -n "$$site" && ln -sfn /usr/lib/python3/dist-packages/bcc "$$site/bcc"
	$(BIN)/python -c 'import bcc'
	touch $@

demo: setup
	$(BIN)/tokentrace demo

test: setup
	$(BIN)/python -m pytest -q --durations=25

bench: setup
	$(BIN)/python bench/overhead.py

clean:
	rm -rf $(VENV) out .pytest_cache
