"""The quickstart's estimate (eagle3pipe/evaluate/estimate.py): stage times scale with the measured slowdown, and the fitted
size is the largest that fits the budget, never below the floor (pure arithmetic, no model)."""
import pytest

from eagle3pipe.evaluate import estimate

KW = dict(epochs=1, prompts=8, new_tokens=64, batch_sizes=[1, 4])


def rates(dtype, slowdown):
    return estimate.Rates(dtype, "test", estimate.REFERENCE[dtype]["fwd"] / slowdown, slowdown)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_stage_times_scale_with_the_machine_and_the_data(dtype):
    fast = estimate.stage_seconds(rates(dtype, 1.0), 100_000, **KW)
    slow = estimate.stage_seconds(rates(dtype, 3.0), 100_000, **KW)
    for stage in ("02 extract", "04 train", "05 evaluate"):
        assert slow[stage] == pytest.approx(3 * fast[stage])
    more = estimate.stage_seconds(rates(dtype, 1.0), 200_000, **{**KW, "epochs": 2})
    assert more["04 train"] > 3.5 * (fast["04 train"] - estimate.REFERENCE[dtype]["04_fixed"])


def test_fit_is_the_largest_size_within_the_budget_and_never_below_the_floor():
    r = rates("float32", 2.0)
    n, secs = estimate.fit(r, 1300, 300, 20 * 60, **KW)
    assert estimate.MIN_ROWS <= n < 300 and sum(secs.values()) <= 20 * 60
    assert sum(estimate.stage_seconds(r, (n + 1) * 1300, **KW).values()) > 20 * 60
    assert estimate.fit(r, 1300, 300, 1, **KW)[0] == estimate.MIN_ROWS  # nothing fits: the floor, said as over
    assert estimate.fit(rates("bfloat16", 1.0), 1300, 300, 10**6, **KW)[0] == 300
