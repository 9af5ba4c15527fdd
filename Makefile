# Two commands: `make demo` and `make test`. Both create .venv when missing,
# install the project into it (only when pyproject.toml changed), then run.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 needed, got " + sys.version'
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m chronostream demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m benchmarks.throughput --json

clean:
	rm -rf $(VENV) build *.egg-info
