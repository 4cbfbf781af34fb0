import itertools
import math
import re

import pytest

from runtime.errors import PolicyError
from runtime.policy import SkipPolicy


SHAPES = ({}, {"decay": "power", "exponent": 2.0}, {"decay": "power", "exponent": 0.5},
          {"decay": "power", "exponent": 3.7, "prefill": "policy"})


def all_policies():
    for L in (1, 2, 5, 12, 24):
        for w, lo, hi in itertools.product(range(0, 3), range(1, L + 1), range(1, L + 1)):
            if w <= lo <= hi <= L:
                for horizon, shape in itertools.product((1, 2, 7, 32), SHAPES):
                    yield SkipPolicy(L, hi, lo, warmup_layers=w, horizon=horizon, **shape)


@pytest.mark.parametrize("policy", list(all_policies())[::13], ids=str)
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
    prompt = set(policy.prefill_layers())
    assert prompt == (set(policy.active_layers(0)) if policy.prefill == "policy" else set(range(L)))
    assert set(policy.active_layers(0)) <= prompt, "the prompt's KV holds every layer a step runs"


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
    assert info.value.param == message.split()[0]  # the field, for a caller to map (the server's param)


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


def test_power_decay_formula_and_exponent_1_is_linear():
    p = SkipPolicy(12, 8, 2, horizon=11, decay="power", exponent=2.0)
    # budget = floor(2 + 6 * (1 - g / 10) ** 2 + 0.5)
    assert [p.budget(g) for g in range(12)] == [8, 7, 6, 5, 4, 4, 3, 3, 2, 2, 2, 2]
    concave = SkipPolicy(12, 8, 2, horizon=11, decay="power", exponent=0.5)
    assert [concave.budget(g) for g in range(12)] == [
        math.floor(2 + 6 * (1 - min(g / 10, 1)) ** 0.5 + 0.5) for g in range(12)]
    assert [concave.budget(g) for g in range(12)][:3] == [8, 8, 7]
    for hi, lo, h in itertools.product(range(1, 13), range(1, 13), (1, 5, 32, 64)):
        if lo <= hi:
            linear = SkipPolicy(12, hi, lo, horizon=h)
            power1 = SkipPolicy(12, hi, lo, horizon=h, decay="power", exponent=1)
            assert [linear.budget(g) for g in range(h + 2)] == [power1.budget(g) for g in range(h + 2)]


@pytest.mark.parametrize("speedup", [1.5, 2, 3, 4, 5])
@pytest.mark.parametrize("exponent", [0.5, 2.0, 3.0])
def test_for_speedup_under_power_decay(speedup, exponent):
    p = SkipPolicy.for_speedup(12, speedup, horizon=32, decay="power", exponent=exponent, prefill="policy")
    assert (p.decay, p.exponent, p.prefill) == ("power", exponent, "policy")
    assert abs(p.theoretical_speedup() - speedup) < 0.35
    # the search is over the power curve's own budgets, not the linear ones
    assert p.theoretical_speedup() == pytest.approx(
        12 * 32 / sum(p.budget(g) for g in range(32)))


@pytest.mark.parametrize("kwargs, message", [
    ({"decay": "cosine"}, r"decay must be one of linear, power, got 'cosine'"),
    ({"decay": "power", "exponent": 0}, r"exponent must be a finite number > 0 \(1 = linear\), got 0"),
    ({"decay": "power", "exponent": -1.5}, r"exponent must be a finite number > 0"),
    ({"decay": "power", "exponent": float("nan")}, r"exponent must be a finite number > 0"),
    ({"exponent": True}, r"exponent must be a finite number > 0 .*got True"),
    ({"exponent": "2"}, r"exponent must be a finite number > 0 .*got '2'"),
    ({"prefill": "half"}, r"prefill must be one of full, policy, got 'half'"),
])
def test_bad_shape_is_a_policy_error(kwargs, message):
    with pytest.raises(PolicyError, match=message) as info:
        SkipPolicy(12, 8, 4, **kwargs)
    assert info.value.param == message.split()[0]
    with pytest.raises(PolicyError, match=message):
        SkipPolicy.for_speedup(12, 2, **kwargs)


def test_shape_round_trips_and_linear_dicts_keep_their_keys():
    p = SkipPolicy(24, 16, 8, warmup_layers=2, horizon=50, decay="power", exponent=1.5, prefill="policy")
    assert SkipPolicy.from_dict(p.to_dict()) == p
    assert p.to_dict()["decay"] == "power" and p.to_dict()["prefill"] == "policy"
    assert "power decay, exponent 1.5" in str(p) and "prompt at step 0's layers" in str(p)
    linear = SkipPolicy(24, 16, 8)
    assert set(linear.to_dict()) == {"num_layers", "max_layers", "min_layers", "warmup_layers", "horizon"}
    assert SkipPolicy.from_dict(linear.to_dict()) == linear


# -- SkipPolicy.from_fields: the one place where policy fields become a policy ---------------------


@pytest.mark.parametrize("fields, want", [
    ({"max_layers": 16, "min_layers": 8}, SkipPolicy(24, 16, 8)),
    ({"max_layers": 16, "min_layers": 8, "warmup_layers": None, "horizon": None}, SkipPolicy(24, 16, 8)),
    ({"max_layers": 16, "min_layers": 8, "horizon": 40, "decay": "power"}, SkipPolicy(24, 16, 8, horizon=40, decay="power")),
    ({"speedup": 2, "warmup_layers": 2}, SkipPolicy.for_speedup(24, 2, horizon=128, warmup_layers=2)),
    (SkipPolicy(24, 12, 6, horizon=9).to_dict(), SkipPolicy(24, 12, 6, horizon=9)),  # round trip
])
def test_from_fields(fields, want):
    assert SkipPolicy.from_fields(24, fields) == want


def test_from_fields_takes_the_horizon_given_when_the_fields_have_none():
    assert SkipPolicy.from_fields(24, {"speedup": 3}, horizon=50) == SkipPolicy.for_speedup(24, 3, horizon=50)


@pytest.mark.parametrize("fields, message", [
    ({"max_layers": 4}, "min_layers is required with max_layers: max_layers and min_layers go together"),
    ({}, "max_layers is required: max_layers and min_layers go together"),
    ({"speedup": 2, "min_layers": 3}, "min_layers and speedup exclude each other"),
    ({"max_layers": 4, "min_layers": 2, "layers": 3}, "layers is not a policy field; a policy has max_layers, "
                                                      "min_layers, warmup_layers, horizon, decay, exponent, prefill"),
    ({"num_layers": 12, "max_layers": 4, "min_layers": 2}, "policy is for 12 layers but the model has 24"),
    ({"max_layers": 30, "min_layers": 2}, "max_layers (30) must be <= num_layers (24)"),
])
def test_from_fields_refuses_with_the_field_first(fields, message):
    with pytest.raises(PolicyError, match=re.escape(message)):
        SkipPolicy.from_fields(24, fields)


def test_a_models_own_policies_per_speedup_are_checked():
    from runtime.policy import speedup_policies

    default = SkipPolicy(30, 30, 30, horizon=64)  # the model's: horizon, warm-up and shape
    table = speedup_policies(default, {2: {"max_layers": 17, "min_layers": 13}})
    assert table == {"2": {"max_layers": 17, "min_layers": 13}}  # string keys, as in a manifest
    assert SkipPolicy(30, 17, 13, horizon=64).theoretical_speedup() == pytest.approx(2, abs=0.05)
    with pytest.raises(PolicyError, match=r"speedup_policies\['2'\]: 20->15 is a 1\.71x policy over 64 steps, not 2x"):
        speedup_policies(default, {"2": {"max_layers": 20, "min_layers": 15}})
    with pytest.raises(PolicyError, match=r"speedup_policies: 'fast' is not a speedup >= 1"):
        speedup_policies(default, {"fast": {"max_layers": 17, "min_layers": 13}})
    with pytest.raises(PolicyError, match=r"must hold max_layers and min_layers"):
        speedup_policies(default, {"2": {"max_layers": 17}})
    with pytest.raises(PolicyError, match=r"min_layers \(13\) must be <= max_layers \(12\)"):
        speedup_policies(default, {"2": {"max_layers": 12, "min_layers": 13}})


@pytest.mark.parametrize("policy, budgets", [
    # the linear decay lands on x.5 here: half rounds up (floor(x + 0.5)), never to the even neighbour
    # as Python's round() would (step 1: 4.5 -> 5, not 4; 6.5 -> 7, not 6)
    (SkipPolicy(6, 5, 4, horizon=3), [5, 5, 4, 4]),
    (SkipPolicy(12, 8, 5, horizon=3), [8, 7, 5, 5]),
    (SkipPolicy(12, 9, 5, horizon=3), [9, 7, 5]),
])
def test_a_budget_halfway_between_two_layer_counts_rounds_up(policy, budgets):
    assert [policy.budget(g) for g in range(len(budgets))] == budgets
