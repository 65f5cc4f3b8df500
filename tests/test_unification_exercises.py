"""Notebook 04's exercise checkers (``mxlib.workbook.checks``), thresholds (``mxlib.formats``) and threshold lines
(``mxlib.workbook.figures``), against hand-computed answers.

The synthetic experts of ``expert_scale_ratio`` put the smallest expert's amax at ``ratio`` and the
largest at 1, so its largest ue4m3 block scale under the unified scale is ``e4m3(448 * ratio)``:
subnormal below ``2**-6 / 448``, zero (every block flushed) at or below ``2**-10 / 448``.
"""

import math

import pytest

from mxlib.formats import NVFP4_FLUSH_RATIO, NVFP4_SUBNORMAL_RATIO
from mxlib.workbook import checks


def test_thresholds_by_hand():
    assert NVFP4_SUBNORMAL_RATIO == 2.0**-6 / 448 and NVFP4_FLUSH_RATIO == 2.0**-10 / 448


def test_largest_flushing_power_of_two_is_2_to_the_minus_19():
    # 448 * 2**-19 = 0.875 * 2**-10 rounds to 0; 448 * 2**-18 = 1.75 * 2**-10 rounds to 2**-9
    answers = [n for n in range(0, 26) if checks.is_largest_flushing_power_of_two(2.0**-n)]
    assert answers == [19]
    assert not checks.is_largest_flushing_power_of_two(3 * 2.0**-21)  # flushes, but not a power of two
    with pytest.raises(ValueError, match="ratio"):
        checks.is_largest_flushing_power_of_two(0.0)


def test_loses_without_flushing_window():
    # above the subnormal threshold nothing is lost; at and below the flush threshold everything is
    assert not checks.loses_without_flushing(2.0**-12)
    assert not checks.loses_without_flushing(NVFP4_FLUSH_RATIO)
    hits = [x / 4 for x in range(4 * 12, 4 * 20) if checks.loses_without_flushing(2.0 ** -(x / 4))]
    assert hits, "some ratio between the two thresholds must lose > 2 dB without flushing"
    assert all(NVFP4_FLUSH_RATIO < 2.0**-h < NVFP4_SUBNORMAL_RATIO for h in hits), hits
    assert checks.loses_without_flushing(2.0**-16.5)


def test_threshold_lines_on_a_log_axis():
    go = pytest.importorskip("plotly.graph_objects")
    from mxlib.workbook import figures

    fig = go.Figure(go.Scatter(x=[1e-6, 1e-2], y=[-1.0, 20.0]))
    fig.update_xaxes(type="log")
    figures.add_scale_ratio_thresholds(fig)
    lines = fig.data[1:]
    assert [tr.x[0] for tr in lines] == [NVFP4_SUBNORMAL_RATIO, NVFP4_FLUSH_RATIO]
    assert all(tuple(tr.y) == (-1.0, 20.0) and math.isclose(tr.x[0], tr.x[1]) for tr in lines)
    # lines get no autorange padding: the axis spans every x, the flush threshold included, with room either side
    low, high = fig.layout.xaxis.range
    assert low < math.log10(min(1e-6, NVFP4_FLUSH_RATIO)) and high > math.log10(1e-2), (low, high)
    fixed = go.Figure(go.Scatter(x=[1e-6, 1e-2], y=[0.0, 1.0]))
    fixed.update_xaxes(type="log", range=[-3, 0])
    assert figures.add_scale_ratio_thresholds(fixed).layout.xaxis.range == (-3, 0)  # a range set by the caller stays
