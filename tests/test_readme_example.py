"""README's Python example, run as written: the first ```python block under "## Example".

The block is read from README.md, executed on the CPU (small shapes, a few seconds), and the
objects it leaves behind are checked for the shapes and dtypes the README states. The block's
own asserts (QDQ equal to dequantize(quantize(x)), the emulated forward close to the bf16 one)
run inside it: if the README's example stops working, this test fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
HEADING = "## Example"


def readme_example(text: str) -> str:
    """The first ```python block after the line ``## Example`` (up to the next ``## `` heading)."""
    lines = text.splitlines()
    try:
        start = lines.index(HEADING)
    except ValueError:
        raise AssertionError(f"README.md has no {HEADING!r} heading") from None
    section = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        section.append(line)
    m = re.search(r"^```python\n(.*?)^```$", "\n".join(section) + "\n", flags=re.S | re.M)
    if m is None:
        raise AssertionError(f"README.md: no ```python block under {HEADING!r}")
    return m.group(1)


def test_extraction_takes_the_first_python_block_of_the_section():
    text = (
        "# t\n```python\nx = 0\n```\n## Example\ntext\n```bash\nls\n```\n```python\ny = 1\n```\n"
        "```python\nz = 2\n```\n## Next\n"
    )
    assert readme_example(text) == "y = 1\n"
    with pytest.raises(AssertionError, match="no ```python block"):
        readme_example("## Example\ntext\n## Next\n```python\nx = 1\n```\n")


def test_readme_example_runs_and_makes_what_it_says():
    code = readme_example(README.read_text())
    assert re.search(r"^assert ", code, flags=re.M), "the README example should check something with an assert"
    ns: dict = {"__name__": "readme_example"}
    exec(compile(code, str(README) + ":example", "exec"), ns)

    E, H, I, M, top_k = (ns[k] for k in ("E", "H", "I", "M", "top_k"))
    assert ns["w13"].shape == (E, 2 * I, H) and ns["w13"].dtype == torch.bfloat16
    assert ns["w2"].shape == (E, H, I) and ns["w2"].dtype == torch.bfloat16
    # MXFP4: two e2m1 codes a byte, one E8M0 byte per 32 elements
    assert ns["packed"].shape == (2 * I, H // 2) and ns["packed"].dtype == torch.uint8
    assert ns["scale"].shape == (2 * I, H // 32) and ns["scale"].dtype == torch.uint8
    hs = ns["hidden_states"]
    assert ns["a_qdq"].shape == hs.shape and ns["a_qdq"].dtype == hs.dtype
    assert not torch.equal(ns["a_qdq"], hs)  # QDQ changed the values (4 bits cannot hold bf16)
    assert ns["topk_ids"].shape == (M, top_k) and ns["topk_ids"].dtype == torch.int32
    assert ns["topk_weights"].shape == (M, top_k) and ns["topk_weights"].dtype == torch.float32
    assert type(ns["experts"]).__name__ == "OCP_MXQuantizationEmulationTritonExperts"
    for name in ("out", "ref"):
        assert ns[name].shape == (M, H) and ns[name].dtype == torch.bfloat16, name
        assert torch.isfinite(ns[name]).all(), name
    assert not torch.equal(ns["out"], ns["ref"])  # the emulation is not the bf16 MoE itself
    # the number the README's comment states
    assert ns["sqnr_db"](ns["out"], ns["ref"]) == pytest.approx(11.1, abs=0.5)
