# The two commands of the README: `make demo` (main job) and `make test` (every test).
# Both run the idempotent setup first, so they work on a machine that has never seen the project.
SHELL := /bin/bash
VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(VENV)
export PATH := $(VENV)/bin:$(PATH)

.PHONY: setup demo test test-rust test-python conformance

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m tpu_dynamo
	$(PY) examples/run_all.py

test: setup
	$(MAKE) --no-print-directory test-rust test-python

test-rust:
	cargo test --workspace --release --exclude tpu-dynamo-python

test-python:
	$(PY) -m pytest -q tests

# OpInfo conformance of every op_db entry (first 8 float32 samples per op); writes
# tests/conformance/REPORT.md.
conformance: setup
	$(PY) tests/conformance/run.py
