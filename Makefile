# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint format install clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Reinstall when the dependency declaration changes.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PIP) install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/teraio demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(PY) -m pytest -q -ra

clean:
	rm -rf $(VENV) build *.egg-info
