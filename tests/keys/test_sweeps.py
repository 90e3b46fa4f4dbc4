"""The pause of a rotation's sweep (:class:`domain.keys.sweeps.Throttle`): none while writes keep the
pace of the fastest seen with as many writes under way together, a pause growing with the slowdown
beyond it, and a pause holding every writer of the sweep."""

from __future__ import annotations

import threading
import time

import pytest

from domain.keys.sweeps import MAX_PAUSE_SECONDS, SLOWDOWN, Throttle

pytestmark = pytest.mark.unit


def test_no_pause_at_the_pace_of_the_fastest_write():
    throttle = Throttle()
    assert throttle.pause_after(0.10, 5000) == 0.0
    assert throttle.pause_after(0.10 * SLOWDOWN, 5000) == 0.0  # within the slowdown allowed
    assert throttle.pause_after(0.05, 2500) == 0.0  # the same pace per value
    assert throttle.paused == 0.0


def test_a_slower_write_pauses_for_its_slowdown_up_to_the_longest_pause():
    throttle = Throttle()
    throttle.pause_after(0.10, 5000)
    assert throttle.pause_after(0.20, 5000) == pytest.approx(0.20)  # twice the fastest: as long again
    assert throttle.pause_after(0.90, 5000) == MAX_PAUSE_SECONDS
    assert throttle.paused == pytest.approx(0.20 + MAX_PAUSE_SECONDS)


def test_writes_under_way_together_are_compared_with_their_own_fastest():
    throttle = Throttle()
    throttle.pause_after(0.10, 5000, together=1)
    # two writes at once each take longer than one alone: no sign of a busy database
    assert throttle.pause_after(0.18, 5000, together=2) == 0.0
    assert throttle.pause_after(0.19, 5000, together=2) == 0.0
    assert throttle.pause_after(0.36, 5000, together=2) == pytest.approx(0.36)  # twice their fastest
    assert throttle.pause_after(0.20, 5000, together=1) == pytest.approx(0.20)


def test_a_pause_holds_every_writer():
    throttle = Throttle()
    throttle.pause_after(0.01, 100)
    throttle.pause_after(0.05, 100)  # five times the fastest: paused for 0.2 s
    began = time.monotonic()
    waited: list[float] = []
    writers = [threading.Thread(target=lambda: (throttle.wait(), waited.append(time.monotonic()))) for _ in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(5)
    assert len(waited) == 2
    assert all(at - began >= 0.18 for at in waited)
    assert throttle.paused == pytest.approx(0.2)
