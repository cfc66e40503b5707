# Two commands on a fresh clone: `make parity` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: parity test bench docs compat clean

$(STAMP): requirements.lock pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements.lock
	$(BIN)/pip install --quiet --no-deps -e .
	touch $(STAMP)

parity: $(STAMP)
	$(BIN)/mha-parity --json parity-report.json --markdown parity-report.md --plot parity-report.png $(ARGS)

# Two workers (pytest-xdist), one module per worker at a time: the suite is mostly single-threaded
# XLA compiles. ARGS='-n 0' runs it in one process.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile $(ARGS)

bench: $(STAMP)
	$(BIN)/mha-bench --preset quick --json bench.json --markdown bench.md --plot bench.png $(ARGS)

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

# The fast tests against the oldest and newest framework versions of pyproject's ranges (downloads).
compat: $(STAMP)
	$(BIN)/nox -s oldest newest

clean:
	rm -rf $(VENV) build *.egg-info
