"""Test set-up: run Triton kernels in the interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before any kernel module is imported, so it is
set here, at collection time. On a CUDA machine the kernels are compiled and the
tests run on ``cuda``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE


def pytest_collection_modifyitems(config, items):
    """Markers that follow from what a test uses: a test of an executed notebook is a ``notebook``
    test (not in ``make test-fast``); a ``gpu`` test is skipped where there is no CUDA device.

    Under ``pytest-xdist --dist loadgroup`` (``make test-rest``) the tests go to the workers one by one, so that a
    file of long tests (the notebooks at their suggested settings) does not run on one worker while the other
    idles; a test that uses a module- or class-scoped fixture is grouped with the rest of its file
    (``xdist_group``), so that the fixture is still made once. In an xdist worker the units are then put in the
    order ``longest_first`` gives (outside xdist the collection order stays as it is)."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "executed_notebook" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.notebook)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d.scope in ("module", "class", "package") for ds in defs for d in ds):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = longest_first(items)
        if config.getvalue("loadgroup"):
            for item in items:
                _report_group(item)


def _report_group(item) -> None:
    """pytest-xdist's ``loadgroup`` tells the controller an item's group by the node id the worker reports,
    ``<nodeid>@<group>``, which it sets in its own ``pytest_collection_modifyitems`` by assigning ``item._nodeid``.
    From pytest 9.2 a node id is structured (``item._id``) and that assignment no longer reaches it
    (pytest-dev/pytest-xdist#1386): every group is silently split, a module-scoped fixture is made on both workers
    and a worker waits on the other's notebook execution. The suffix is set here where xdist's did not take."""
    group = _group(item)
    ident = getattr(item, "_id", None)
    if not group.startswith("@") or ident is None or not hasattr(type(ident), "parse"):
        return  # no group, or a pytest whose node id xdist's assignment still sets
    want = item.nodeid.split("@")[0] + group
    if item.nodeid != want:
        item._id = type(ident).parse(want)


# The long tests of `make test-rest`: seconds of one worker on the 2-core machine (`--durations`, two workers, setup
# and call; a notebook's execution counts towards the first test that reads it; the fused FP4 naive-blocks and the
# per-token tests scaled by their CPU time after their tiles were widened). Only the order they give matters
# (longest_first): a test missing here, or one whose time has changed, costs balance at the end, never a result.
LONG_TESTS: dict[str, float] = {
    "tests/test_quantize_command.py::test_peak_memory_stays_near_one_layer": 69,
    "tests/test_docs.py::test_python_blocks_run_as_written[docs/getting-started.md]": 42,
    "tests/test_docs.py::test_every_page_renders_without_errors_or_network": 26,
    "tests/test_wheel.py::test_the_installed_wheel_runs_a_notebook_from_its_package_data": 25,
    "tests/test_bad_input.py::test_e2e_peak_memory_stays_near_the_model_bytes": 21,
    "tests/test_fused_fp4.py::test_fused_fp4_naive_blocks_and_standalone_a1[nvfp4]": 20,
    "tests/test_fused_fp4.py::test_fused_fp4_naive_blocks_and_standalone_a1[w_mxfp4_a_mxfp4]": 20,
    "tests/test_notebook_settings.py::test_a_suggested_setting_runs_and_passes_its_checks[06-quick]": 20,
    "tests/test_notebook_settings.py::test_a_suggested_setting_runs_and_passes_its_checks[04-defaults]": 19,
    "tests/test_notebook_settings.py::test_a_suggested_setting_runs_and_passes_its_checks[07-quick]": 19,
    "tests/test_notebooks.py::test_05_fused_emulation_benchmark": 19,
    "tests/test_docs.py::test_the_site_holds_every_page_and_the_notebooks": 19,
    "tests/test_notebooks.py::test_04_scale_unification": 18,
    "tests/test_notebook_settings.py::test_a_suggested_setting_runs_and_passes_its_checks[01-defaults]": 17,
    "tests/test_notebooks.py::test_02_microscaling_formats": 17,
    "tests/test_notebooks.py::test_01_end_to_end[nvfp4]": 17,
    "tests/test_per_token.py::test_fused_per_token_a1_prepass_and_standalone_same_bits[hardware]": 12,
    "tests/test_swigluoai.py::test_emulation_silu_default_unchanged[fused]": 16,
    "tests/test_notebooks.py::test_01_end_to_end[mxfp4]": 16,
    "tests/test_notebook_settings.py::test_a_suggested_setting_runs_and_passes_its_checks[03-defaults]": 16,
    "tests/test_render.py::test_probe_catches_truncation_and_empty_figures": 16,
    "tests/test_docs.py::test_python_blocks_run_as_written[docs/attribution.md]": 15,
    "tests/test_notebooks.py::test_01_end_to_end_gpt_oss": 15,
    "tests/test_per_token.py::test_fused_per_token_a1_prepass_and_standalone_same_bits[vllm]": 10,
    "tests/test_notebooks.py::test_03_scheme_comparison": 14,
    "tests/test_swigluoai.py::test_emulation_backends_with_biases[fp4-kernel-silu]": 14,
    "tests/test_swigluoai.py::test_emulation_backends_with_biases[fp4-kernel-swigluoai]": 14,
    "tests/test_compile.py::test_reference_inductor_bits_equal_eager[quant_dequant_mx e2m1 even]": 14,
    "tests/test_moe.py::test_fp4_experts_both_numerics_against_fp64[vllm-nvfp4]": 14,
    "tests/test_fused_fp4.py::test_fused_fp4_against_fp64[hardware-nvfp4]": 13,
}


def _group(item) -> str:
    """The work unit of ``item`` under ``--dist loadgroup``: its ``xdist_group`` name(s), else the test itself."""
    names = sorted(
        {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    )
    return "@" + "_".join(names) if names else item.nodeid


def longest_first(items: list) -> list:
    """``items`` with the work units (``_group``) holding the most ``LONG_TESTS`` seconds first, the rest after them
    in collection order; a unit's tests stay together and in their order (a module-scoped fixture is made once).

    Under ``--dist loadgroup --no-loadscope-reorder`` pytest-xdist hands the units out in this order, one at a time
    to whichever worker runs low: the long units start first and the short ones fill in at the end, so the workers
    finish close together instead of one running a long test while the other idles."""

    def seconds(item) -> float:
        return LONG_TESTS.get(item.nodeid.split("@")[0], 0.0)

    units: dict[str, list] = {}
    for item in items:
        units.setdefault(_group(item), []).append(item)
    cost = {u: sum(seconds(i) for i in members) for u, members in units.items()}
    order = sorted(units, key=lambda u: -cost[u])  # stable: units of equal cost keep their collection order
    return [item for u in order for item in units[u]]


# ----------------------------------------------------------------------------- executed notebooks
# tests/test_notebooks.py reads an executed notebook's results JSON, tests/test_render.py renders the
# same executed copy in Chromium: each (notebook, parameters) runs once per `pytest` run. Under
# pytest-xdist the workers share the run's base temporary folder, and a file lock per entry lets the
# first worker execute while the others wait and reuse its copy.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kernel_threads() -> int | None:
    """PyTorch's threads for a notebook's kernel under pytest-xdist: the cores shared among the workers (at least
    one), or None outside xdist (PyTorch's own default). Each worker's kernel would otherwise start one OpenMP
    thread per core, and kernels running side by side would spin on cores another kernel holds: on the 2-core
    machine, notebook 06's quick run took 106 s of CPU time at two threads and 18 s at one, the same results to
    the bit but the timings."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2 or os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


# An xdist worker itself takes its share of the cores too (tests that run PyTorch on the CPU, and the processes they
# start, inherit it): two workers of two threads each on two cores spin on each other's cores.
_WORKER_THREADS = _kernel_threads()
if _WORKER_THREADS:
    torch.set_num_threads(_WORKER_THREADS)


def _execute_notebook(name: str, params: dict, out_dir) -> None:
    """papermill ``notebooks/<name>.ipynb`` into ``out_dir/<name>.ipynb`` with ``params`` and
    ``results_path="results.json"`` (relative: the injected parameters hold no absolute path), the
    checkout on ``PYTHONPATH`` and checkpoints in ``out_dir/checkpoints``."""
    import shutil

    import papermill as pm

    from mxlib.workbook.runner import poll_kernel_channels_in_slices

    if params.get("checkpoint_path"):  # a fixture checkpoint, copied to the same relative path in the working folder
        shutil.copytree(
            os.path.join(ROOT, "tests", "fixtures", params["checkpoint_path"]), out_dir / params["checkpoint_path"]
        )

    poll_kernel_channels_in_slices()  # a lost wake-up in a widget cell would otherwise stall the run (nbclient#312)
    with pytest.MonkeyPatch.context() as mp:
        path = os.environ.get("PYTHONPATH", "")
        mp.setenv("PYTHONPATH", os.pathsep.join([ROOT] + [p for p in path.split(os.pathsep) if p]))
        mp.setenv("MXLIB_CACHE", str(out_dir / "checkpoints"))
        threads = _kernel_threads()
        if threads:
            mp.setenv("OMP_NUM_THREADS", str(threads))
        # timeouts turn a stalled kernel into a failure instead of a hung test
        pm.execute_notebook(
            os.path.join(ROOT, "notebooks", f"{name}.ipynb"),
            str(out_dir / f"{name}.ipynb"),
            parameters=dict(params, results_path="results.json"),
            kernel_name="python3",
            cwd=str(out_dir),
            progress_bar=False,
            start_timeout=180,
            execution_timeout=900,
        )


@pytest.fixture(scope="session")
def executed_notebook(tmp_path_factory):
    """``executed_notebook(name, params) -> folder`` holding ``<name>.ipynb`` (executed) and
    ``results.json``; executed once per run for each distinct ``(name, params)``."""
    import hashlib
    import json

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the workers of this run
    root = root / "executed-notebooks"
    root.mkdir(parents=True, exist_ok=True)

    def run(name: str, params: dict):
        key = hashlib.sha1(json.dumps([name, params], sort_keys=True).encode()).hexdigest()[:12]
        out = root / f"{name}-{key}"
        with FileLock(str(out) + ".lock"):
            if not (out / "done").exists():
                out.mkdir(exist_ok=True)
                _execute_notebook(name, params, out)
                (out / "done").write_text("ok")
        return out

    return run
