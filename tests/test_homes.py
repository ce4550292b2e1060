"""The one home policy (`swaprl.homes`): what `decide` gives whole parameters for a room, the one formula for a
device's room, and an explicit split's middle-byte rule. The runtime's use of it is in tests/test_split.py, the
planner's in tests/test_plan.py."""

from __future__ import annotations

import pytest

from swaprl.homes import HOMES, Capacity, Room, by_fractions, decide, totals

SIZES = [40, 10, 10, 30, 10]  # an embedding first, as in a causal LM's optimizer


def test_everything_stays_on_the_device_where_it_fits_in_both_phases():
    assert decide(SIZES, Capacity(device=100, resident=100)) == ["device"] * 5
    assert decide(SIZES, Capacity()) == ["device"] * 5  # no bound known: nothing moves


def test_the_homes_fill_in_order_device_then_swap_then_host():
    homes = decide(SIZES, Capacity(device=50, resident=90))
    assert homes == ["device", "device", "swap", "swap", "host"]
    assert totals(SIZES, homes) == {"device": 50, "swap": 40, "host": 10}


def test_a_parameter_that_does_not_fit_its_home_ends_it_and_the_homes_stay_runs():
    homes = decide([10, 60, 5], Capacity(device=50, resident=200))
    assert homes == ["device", "swap", "swap"]  # the small one after does not jump back onto the device
    assert [HOMES.index(h) for h in homes] == sorted(HOMES.index(h) for h in homes)


def test_the_device_home_never_holds_more_than_training_has_room_for():
    assert decide(SIZES, Capacity(device=100, resident=50)) == ["device", "device", "host", "host", "host"]


def test_without_room_in_train_everything_streams():
    assert decide(SIZES, Capacity(device=0, resident=0)) == ["host"] * 5


def test_a_later_moment_only_lowers_the_room():
    c = Capacity(device=50).within(resident=80)
    assert c == Capacity(device=50, resident=80)
    assert c.within(device=70) == c and c.within(device=30).device == 30


def test_the_room_formula_counts_the_cache_and_takes_back_the_peak_and_the_reserve():
    room = Room(free=100, cached=20, reserve=10, regrow=30)
    assert room.for_new() == 80
    # the step's temporaries are made after the peak: beside what is in use now, not beside the peak
    assert room.for_new(temporaries=1.5) == min(80, (100 + 20 - 10) // 1.5)
    assert Room(free=5, reserve=10).for_new() == -5  # what is missing, not zero


@pytest.mark.parametrize("split", [{"device": 0.3, "swap": 0.3, "host": 0.4}, {"swap": 1.0}, {"device": 1.0},
                                   {"device": 0.05, "host": 0.95}])
def test_an_explicit_split_gives_each_parameter_the_home_its_middle_byte_falls_in(split):
    homes = by_fractions(SIZES, split)
    assert [HOMES.index(h) for h in homes] == sorted(HOMES.index(h) for h in homes)
    edge = 0.0
    for home in HOMES:
        edge += split.get(home, 0.0) * sum(SIZES)
        got = sum(n for n, h in zip(SIZES, homes) if HOMES.index(h) <= HOMES.index(home))
        assert abs(got - edge) <= max(SIZES) / 2, (home, got, edge)


def test_a_split_at_the_parameters_edges_gives_back_what_decide_gave():
    """The planner prints the fractions `decide` chose and the runtime reads them with `by_fractions`: the same
    parameters land in the same homes."""
    homes = decide(SIZES, Capacity(device=50, resident=80))
    held = totals(SIZES, homes)
    assert by_fractions(SIZES, {h: n / sum(SIZES) for h, n in held.items()}) == homes
