# Two entry points for a fresh machine; each creates .venv and installs into it.
#   make workbook   run every notebook on its defaults (papermill), executed copies + HTML under build/
#   make test       the fast tier (unit and Triton-interpreter tests), then the notebook, rendering and
#                   slow tests (every notebook at the tiny model preset), then nbval over the light notebooks
# Also: make test-fast (the fast tier alone, a few minutes), make lint (ruff, notebooks without outputs),
# make dist (sdist and wheel built and checked), make lab (JupyterLab on the notebooks), make bench (GPU benchmarks).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch that this machine keeps on disk; pip's cap here is torch<=2.14.1.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.mxlib-installed
PYTEST_WORKERS ?= 2
# glibc returns freed pages to the OS and maps fresh ones between PyTorch ops; on
# full-size expert weights that costs more than the arithmetic. Keep them mapped.
export MALLOC_TRIM_THRESHOLD_ ?= 4000000000
export MALLOC_MMAP_THRESHOLD_ ?= 4000000000

.PHONY: install test test-fast test-rest test-notebooks lint dist workbook bench clean

# pip byte-compiles what it installs one file at a time (about 50 s of the install here); compileall on every core
# does the same in half the time. A file that does not compile (some packages ship Python-2 examples) is
# compiled, or refused, when something imports it, as it would be without pip's pass: its status is not fatal.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-compile -e ".[dev]"
	$(PY) -m compileall -q -j 0 $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") > /dev/null \
	  || echo "compileall: some files of the installed packages do not compile; they are left to import time"
	touch $@

install: $(STAMP)

test: test-fast test-rest test-notebooks

PYTEST := TRITON_INTERPRET=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -q
# the long tests one by one (tests/conftest.py keeps a file whose fixtures are module-scoped together); the 30
# slowest printed at the end, so that a CI log says where the time went
PYTEST_REST := TRITON_INTERPRET=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder -q --durations=30

# Unit and kernel tests: the Triton kernels run in the interpreter on the CPU; no notebook, no Chromium.
test-fast: $(STAMP)
	$(PYTEST) -m "not notebook and not slow" tests

# Every notebook through papermill at the tiny preset (tests/test_notebooks.py), their HTML drawn in
# headless Chromium (tests/test_render.py; ensure_chromium.sh installs it when it is missing), and the
# slow tests.
test-rest: $(STAMP)
	sh tools/ensure_chromium.sh
	$(PYTEST_REST) -m "notebook or slow" tests

lint: $(STAMP)
	$(VENV)/bin/ruff check mxlib tests tools
	$(VENV)/bin/ruff format --check mxlib tests tools
	$(VENV)/bin/nbstripout --keep-id --verify notebooks/*.ipynb

# The sdist and the wheel, built as a release would be (python -m build: the sdist, then the wheel from it),
# twine's metadata and README check, then tests/test_wheel.py on these files: the wheel holds the package,
# py.typed, the notebooks and LICENSE and nothing else; no notebook or test tool outside the extras; one
# notebook runs from the wheel installed apart from the checkout.
DIST := build/dist
dist: $(STAMP)
	rm -rf $(DIST) mxlib.egg-info
	$(PY) -m build --outdir $(DIST) .
	$(VENV)/bin/twine check --strict $(DIST)/*
	MXLIB_DIST=$(CURDIR)/$(DIST) $(PY) -m pytest -p no:xdist -q tests/test_wheel.py

# nbval executes the notebooks whose defaults are light; the full-size defaults (3 B parameters) run in
# `make workbook` only.
NBVAL_NOTEBOOKS := notebooks/02_microscaling_formats.ipynb notebooks/05_fused_emulation_benchmark.ipynb
test-notebooks: $(STAMP)
	$(PY) -m pytest -p no:xdist --nbval-lax -q $(NBVAL_NOTEBOOKS)

# a checkout keeps its checkpoint cache in build/checkpoints (an installed mxlib: $MXLIB_CACHE or ~/.cache/mxlib)
workbook: $(STAMP)
	MXLIB_CACHE=$(CURDIR)/build/checkpoints $(PY) -m mxlib.workbook --notebooks notebooks --out build/workbook

bench: $(STAMP)
	$(PY) -m mxlib.bench

# The documentation site (mkdocs.yml) into build/docs: open build/docs/index.html, nothing comes from the network.
.PHONY: docs
# It needs the docs extra's packages only (mkdocstrings reads the sources without importing them): no torch, no
# triton, no dev stack. The list is pyproject.toml's `docs` extra, read with tomllib.
DOCS_STAMP := $(VENV)/.mxlib-docs-installed
$(DOCS_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	mkdir -p build
	$(PY) -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))' > build/docs-requirements.txt
	$(PY) -m pip install -q -r build/docs-requirements.txt
	touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/docs

clean:
	rm -rf build .pytest_cache

# JupyterLab on the notebooks (plotly figures and the explorer widgets render in it), started by
# tools/lab.sh (tests/test_lab.py starts the same script): no browser opened, on LAB_IP:LAB_PORT (a port in
# use is an error), --allow-root only when run as root; the URL with the token is printed. It opens the
# tracked notebooks themselves and saves them without outputs (nbstripout --keep-id before each write,
# tools/jupyter_lab_config.py), so an edit lands in notebooks/ in the form make lint wants; executed copies
# with outputs come from make workbook. From a container: make lab LAB_IP=0.0.0.0.
LAB_IP ?= 127.0.0.1
LAB_PORT ?= 8888
.PHONY: lab
lab: $(STAMP)
	MXLIB_CACHE=$(CURDIR)/build/checkpoints LAB_IP=$(LAB_IP) LAB_PORT=$(LAB_PORT) sh tools/lab.sh $(PY) notebooks
