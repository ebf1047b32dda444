# paravt — two commands matter: `make train` (the main job) and `make test` (the suite).
# Both create .venv in the checkout and install into it on first use.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PIP     := $(VPY) -m pip --disable-pip-version-check

.PHONY: install train test lint format bench clean

$(STAMP): requirements.txt pyproject.toml setup.py
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-build-isolation --no-deps -e .
	@touch $(STAMP)

install: $(STAMP)

train: install
	$(VPY) -m paravt.train $(ARGS)

test: install
	$(VPY) -m pytest tests -q

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

bench: install
	$(VPY) -m pytest bench/ --benchmark-only

clean:
	rm -rf build *.egg-info .pytest_cache
