# The commands of the README: `make demo` (main job), `make test` (every test), `make bench`,
# `make conformance`.
# All run the idempotent setup first, so they work on a machine that has never seen the project.
SHELL := /bin/bash
VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
export VIRTUAL_ENV := $(VENV)
export PATH := $(VENV)/bin:$(PATH)

.PHONY: setup demo test test-rust test-python bench conformance

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

# Eager vs Inductor vs backend="tpu", one process per model: bench/RESULTS.md and bench/ratios.png.
bench: setup
	$(PY) bench/bench.py

# OpInfo conformance of every op_db entry (first 8 float32 samples per op); writes
# tests/conformance/REPORT.md.
conformance: setup
	$(PY) tests/conformance/run.py
