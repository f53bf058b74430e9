# The two commands of the README's quick start: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tensorpar-installed

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m tensorpar demo --tp 2

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
