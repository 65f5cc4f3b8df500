# Two entry points for a fresh machine; each creates .venv and installs into it.
#   make workbook   run every notebook on its defaults (papermill), executed copies + HTML under build/
#   make test       unit tests, Triton kernels under TRITON_INTERPRET=1; every notebook at the tiny
#                   model preset (tests/test_notebooks.py); nbval over the notebooks with light defaults
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

.PHONY: install test test-unit test-notebooks workbook bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(STAMP)

test: test-unit test-notebooks

# Unit and kernel tests: the Triton kernels run in the interpreter on the CPU. tests/test_render.py
# draws the executed notebooks in headless Chromium: ensure_chromium.sh installs it when it is missing.
test-unit: $(STAMP)
	sh tools/ensure_chromium.sh
	TRITON_INTERPRET=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -q tests

# Every notebook through papermill at the tiny preset, results read back (tests/test_notebooks.py,
# also part of test-unit's run of tests/); nbval executes the notebooks whose defaults are light.
# The full-size defaults (3 B parameters) run in `make workbook` only.
NBVAL_NOTEBOOKS := notebooks/02_microscaling_formats.ipynb notebooks/05_fused_emulation_benchmark.ipynb
test-notebooks: $(STAMP)
	$(PY) -m pytest -p no:xdist --nbval-lax -q $(NBVAL_NOTEBOOKS)

# a checkout keeps its checkpoint cache in build/checkpoints (an installed mxlib: $MXLIB_CACHE or ~/.cache/mxlib)
workbook: $(STAMP)
	MXLIB_CACHE=$(CURDIR)/build/checkpoints $(PY) -m mxlib.workbook --notebooks notebooks --out build/workbook

bench: $(STAMP)
	$(PY) -m mxlib.bench

clean:
	rm -rf build .pytest_cache

# JupyterLab on the notebooks (plotly figures and the explorer widgets render in it).
.PHONY: lab
lab: $(STAMP)
	MXLIB_CACHE=$(CURDIR)/build/checkpoints $(VENV)/bin/jupyter lab --notebook-dir=notebooks
