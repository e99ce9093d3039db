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

# kvikio without cupy and the CUDA toolkit (~115 MB instead of 2.7 GB), for the kvikio tier's tests on
# CPU with the driver stand-in of runtime/testing.py. Users with GPUs install the `gds` extra instead.
KVIKIO_STAMP := $(VENV)/.kvikio-stamp
$(KVIKIO_STAMP): $(STAMP)
	$(PIP) install --quiet --no-deps kvikio-cu12==26.10.0 libkvikio-cu12==26.10.0 rapids-logger==0.3.0 \
		cuda-pathfinder==1.9.0 nvidia-cufile-cu12==1.14.1.1
	touch $(KVIKIO_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/teraio demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# Two pytest workers (pytest-xdist): Inductor compiles are mostly single-threaded Python, so the suite
# takes about 60% of its serial time on 2 cores. TEST_WORKERS=0 runs it in one process. --maxschedchunk 1:
# Note: [The longest tests start first] in tests/conftest.py.
TEST_WORKERS ?= 2
test: lint $(KVIKIO_STAMP)
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --maxschedchunk 1 --durations=40

clean:
	rm -rf $(VENV) build *.egg-info
