# The two set-up commands: `make demo` and `make test`. Each creates .venv at the
# repository root on first use and installs the pinned stack (constraints.txt).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-peers test-slow bench bench-compare clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/ckptstore demo --store runs/demo-store

# Two workers, each test file on one of them (a file's fixtures and servers stay in one process).
test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

test-peers: $(STAMP)
	$(BIN)/python -m pytest -q tests/peers

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

bench-compare: $(STAMP)
	$(BIN)/python -m benchmarks.compare benchmarks/results/latest.json benchmarks/results/baseline.json

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
