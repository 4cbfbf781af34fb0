import itertools

import pytest

from runtime.errors import PolicyError
from runtime.policy import SkipPolicy


def all_policies():
    for L in (1, 2, 5, 12, 24):
        for w, lo, hi in itertools.product(range(0, 3), range(1, L + 1), range(1, L + 1)):
            if w <= lo <= hi <= L:
                for horizon in (1, 2, 7, 32):
                    yield SkipPolicy(L, hi, lo, warmup_layers=w, horizon=horizon)


@pytest.mark.parametrize("policy", list(all_policies())[::7], ids=str)
def test_invariants(policy):
    L, w = policy.num_layers, policy.warmup_layers
    steps = range(policy.horizon + 5)
    budgets = [policy.budget(g) for g in steps]
    assert budgets[0] == policy.max_layers
    assert budgets[policy.horizon - 1] == policy.min_layers or policy.horizon == 1
    assert all(b1 >= b2 for b1, b2 in zip(budgets, budgets[1:])), "budget never grows"
    assert all(policy.min_layers <= b <= policy.max_layers for b in budgets)
    previous = set(range(L))
    for g in steps:
        active = policy.active_layers(g)
        assert len(active) == len(set(active)) == policy.budget(g)
        assert list(active) == sorted(active)
        assert set(range(w)) <= set(active), "warm-up layers always run"
        upper = [i for i in active if i >= w]
        assert upper == list(range(L - len(upper), L)), "the top layers are kept, the middle skipped"
        assert set(active) <= previous, "active sets are nested"
        previous = set(active)


def test_full_depth_is_the_plain_model():
    p = SkipPolicy.full_depth(12)
    assert all(p.active_layers(g) == tuple(range(12)) for g in range(300))
    assert p.theoretical_speedup() == 1.0
    assert SkipPolicy(12, 12, 12, warmup_layers=0).active_layers(5) == tuple(range(12))


def test_linear_decay_matches_design_formula():
    p = SkipPolicy(24, 16, 8, warmup_layers=1, horizon=9)
    assert [p.budget(g) for g in range(11)] == [16, 15, 14, 13, 12, 11, 10, 9, 8, 8, 8]
    assert p.active_layers(8) == (0, *range(17, 24))
    assert p.theoretical_speedup() == pytest.approx(24 / 12)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_layers=12, max_layers=8, min_layers=10), "min_layers (10) must be <= max_layers (8)"),
    (dict(num_layers=12, max_layers=13, min_layers=4), "max_layers (13) must be <= num_layers (12)"),
    (dict(num_layers=12, max_layers=8, min_layers=2, warmup_layers=3), "warmup_layers (3) must be <= min_layers (2)"),
    (dict(num_layers=12, max_layers=8, min_layers=0, warmup_layers=0), "min_layers must be >= 1, got 0"),
    (dict(num_layers=12, max_layers=8, min_layers=4, horizon=0), "horizon must be >= 1, got 0"),
    (dict(num_layers=12, max_layers=8, min_layers=4, warmup_layers=-1), "warmup_layers must be >= 0, got -1"),
    (dict(num_layers=12, max_layers=8.0, min_layers=4), "max_layers must be an int, got 8.0"),
])
def test_impossible_policy_names_the_bound(kwargs, message):
    with pytest.raises(PolicyError) as info:
        SkipPolicy(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("L, speedup, expected", [
    (24, 1, (24, 24)), (24, 2, (16, 8)), (32, 4, (11, 5)), (12, 2, (8, 4))])
def test_for_speedup_picks_paper_like_bounds(L, speedup, expected):
    p = SkipPolicy.for_speedup(L, speedup, horizon=128)
    assert (p.max_layers, p.min_layers) == expected
    assert p.theoretical_speedup() == pytest.approx(speedup, rel=0.05)


@pytest.mark.parametrize("L, speedup", [(24, 5), (32, 3), (12, 3), (8, 2)])
def test_for_speedup_is_close_to_target(L, speedup):
    assert SkipPolicy.for_speedup(L, speedup, horizon=64).theoretical_speedup() == pytest.approx(speedup, rel=0.1)


def test_for_speedup_out_of_range():
    with pytest.raises(PolicyError, match=r"speedup 30 is out of range for 24 layers .* \[1, 24\]"):
        SkipPolicy.for_speedup(24, 30)
    with pytest.raises(PolicyError, match="speedup 0.5 is out of range"):
        SkipPolicy.for_speedup(24, 0.5)


def test_dict_round_trip():
    p = SkipPolicy(24, 16, 8, warmup_layers=2, horizon=50)
    assert SkipPolicy.from_dict(p.to_dict()) == p
