"""The deadline helpers on real threads, timers and generators (no network, no model)."""
import time

import pytest

from eagle3pipe.base import deadlines
from eagle3pipe.base.errors import UsageError


def test_call_answers_raises_or_gives_up_at_its_deadline():
    assert deadlines.call(lambda a, b=0: a + b, 5, "sum", 2, b=3) == 5
    with pytest.raises(KeyError):
        deadlines.call({}.__getitem__, 5, "lookup", "x")
    t0 = time.time()
    with pytest.raises(UsageError, match="stall: no answer within 0.3 s"):
        deadlines.call(time.sleep, 0.3, "stall", 30)
    assert time.time() - t0 < 5


def test_iterate_bounds_the_wait_for_each_item_not_the_whole_stream():
    def slow_but_steady():
        for i in range(5):
            time.sleep(0.05)
            yield i
    assert list(deadlines.iterate(slow_but_steady(), 1, "steady")) == [0, 1, 2, 3, 4]

    def stalls():
        yield 1
        time.sleep(30)
        yield 2
    got = []
    with pytest.raises(UsageError, match="stream: no record within 0.3 s"):
        for x in deadlines.iterate(stalls(), 0.3, "stream"):
            got.append(x)
    assert got == [1]

    def breaks():
        yield 1
        raise OSError("reset by peer")
    with pytest.raises(OSError, match="reset by peer"):
        list(deadlines.iterate(breaks(), 1, "broken"))


def test_time_budget_interrupts_python_code_and_restores_the_alarm():
    t0 = time.time()
    with pytest.raises(deadlines.TemplateTimeout):
        with deadlines.time_budget(0.2):
            while True:
                pass
    assert time.time() - t0 < 5
    with deadlines.time_budget(5):  # a block that ends in time: the timer is cancelled
        sum(range(1000))
    time.sleep(0.1)  # no stray alarm


@pytest.mark.parametrize("name,value", [("EAGLE3_TEMPLATE_TIMEOUT_S", v) for v in ["nan", "inf", "-1", "0", "ten", "1e12"]]
                         + [("EAGLE3_HUB_TIMEOUT_S", "0"), ("EAGLE3_LIFELINE_GRACE", "abc"),
                            ("EAGLE3_LIFELINE_GRACE", "-1")])
def test_deadline_settings_refuse_what_is_not_a_number_of_seconds(monkeypatch, name, value):
    """Every knob checked at a stage's start (a bad watchdog grace found only once the stage died left an orphan)."""
    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError, match=f"{name}={value}: expected a number of seconds"):
        deadlines.check_environment()
    monkeypatch.setenv(name, "0" if name == "EAGLE3_LIFELINE_GRACE" else "2.5")
    deadlines.check_environment()
