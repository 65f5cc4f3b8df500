# Two entry points for a fresh machine; each creates .venv and installs into it.
#   make workbook   run every notebook on its defaults (papermill), executed copies + HTML under build/
#   make test       unit tests, Triton kernels under TRITON_INTERPRET=1, nbval over notebooks/
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

# Unit and kernel tests: the Triton kernels run in the interpreter on the CPU.
test-unit: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -q tests

# nbval executes every notebook (in one process: a full-size model needs the memory).
test-notebooks: $(STAMP)
	$(PY) -m pytest -p no:xdist --nbval-lax -q notebooks

workbook: $(STAMP)
	$(PY) -m mxlib.workbook --out build/workbook

bench: $(STAMP)
	$(PY) -m mxlib.bench

clean:
	rm -rf build .pytest_cache

# JupyterLab on the notebooks (plotly figures and the explorer widgets render in it).
.PHONY: lab
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks
