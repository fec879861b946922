"""colomem.engines.background: a piece of a trainer's work in a thread, collected before the trainer goes on."""
import threading

import pytest

from colomem.engines.background import Background, BackgroundSlot
from colomem.errors import ColomemError, TransferTimeoutError


def test_the_value_or_the_error_of_the_thread_reaches_the_caller():
    assert Background(lambda: 7, "seven").result(float("inf")) == 7     # an infinite bound waits without one

    def fail():
        raise ColomemError("broke in the thread")
    with pytest.raises(ColomemError, match="broke in the thread"):
        Background(fail, "failing").result(5)


def test_a_slot_keeps_a_piece_that_timed_out_and_collects_it_later():
    gate = threading.Event()
    slot = BackgroundSlot()
    assert slot.collect(1) == 0.0 and not slot.busy                      # nothing ran: nothing to wait for
    slot.start(lambda: gate.wait(30), "gated work")
    with pytest.raises(RuntimeError, match="not collected"):
        slot.start(lambda: None, "second")                               # one at a time
    with pytest.raises(TransferTimeoutError, match="gated work did not finish"):
        slot.collect(0.01)
    assert slot.busy                                                     # still running: kept
    gate.set()
    assert slot.collect(5) >= 0.0 and not slot.busy


def test_a_slot_whose_piece_failed_is_free_again():
    slot = BackgroundSlot()
    slot.start(lambda: 1 / 0, "dividing")
    with pytest.raises(ZeroDivisionError):
        slot.collect(5)
    assert not slot.busy
    slot.start(lambda: None, "next")
    slot.collect(5)
