"""``mxlib.workbook.runner.poll_kernel_channels_in_slices``: waits on a kernel channel cut into slices.

A stand-in for jupyter_client's asyncio ``get_msg`` records the timeouts it is given: every wait
is at most one slice, a message that arrives late is still returned, an overall timeout still ends
in ``Empty``, and patching twice wraps once.
"""

import asyncio
import time
from queue import Empty

import pytest


class _Channel:
    """Answers on the ``ready_after``-th call; records each call's timeout."""

    def __init__(self, ready_after):
        self.timeouts, self.ready_after = [], ready_after

    async def get_msg(self, timeout=None):
        self.timeouts.append(timeout)
        if len(self.timeouts) >= self.ready_after:
            return {"msg": len(self.timeouts)}
        await asyncio.sleep(timeout)
        raise Empty


@pytest.fixture
def sliced(monkeypatch):
    from jupyter_client import channels

    from mxlib.workbook import runner

    monkeypatch.setattr(channels.AsyncZMQSocketChannel, "get_msg", _Channel.get_msg)
    runner.poll_kernel_channels_in_slices(0.01)
    runner.poll_kernel_channels_in_slices(0.01)  # idempotent
    return channels.AsyncZMQSocketChannel.get_msg


def test_waits_are_cut_into_slices(sliced):
    ch = _Channel(ready_after=4)
    assert asyncio.run(sliced(ch, timeout=None)) == {"msg": 4}  # no timeout: looks again until it comes
    assert ch.timeouts == [0.01] * 4
    ch = _Channel(ready_after=3)
    assert asyncio.run(sliced(ch, timeout=5.0)) == {"msg": 3}
    assert all(0 <= t <= 0.01 for t in ch.timeouts)


def test_the_overall_timeout_still_ends_in_empty(sliced):
    ch = _Channel(ready_after=10**9)
    t0 = time.monotonic()
    with pytest.raises(Empty):
        asyncio.run(sliced(ch, timeout=0.05))
    assert time.monotonic() - t0 >= 0.05 and len(ch.timeouts) >= 2
    assert getattr(sliced, "_mxlib_sliced", False)
