# Two set-up commands a new user needs (see README): `make demo` and `make test`.
# Each installs what it needs into .venv first (torch pinned by constraints.txt to a CPU build).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install system-deps lint clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,onnx]'
	touch $(STAMP)

install: $(STAMP)

system-deps:
	bash scripts/install-system-deps.sh

demo: system-deps install
	$(BIN)/ftpipe-iot demo --json

test: system-deps install
	$(BIN)/ruff check ftpipe_iot tests benchmarks
	$(BIN)/pytest -q -p no:cacheprovider --timeout 300 -n 2 --dist loadfile

lint: install
	$(BIN)/ruff check ftpipe_iot tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
