"""export.verify's comparisons."""

import numpy as np

from export.verify import _layers_follow, _logit_diff, _step_logits
from runtime.policy import SkipPolicy
from runtime.stats import StepStats, TokenEvent


def test_logit_diff_skips_rows_that_have_finished():
    """Row 1 emits EOS at step 0: transformers' later logits for it (on pad tokens) are not ours."""
    ours = [np.zeros((2, 4)), np.zeros((2, 4)), np.zeros((2, 4))]
    theirs = [np.zeros((2, 4)), np.array([[0.5, 0, 0, 0], [9.0, 0, 0, 0]]), np.zeros((2, 4))]
    tokens = [[3, 3, 3], [2, 1, 1]]  # row 1 padded after its EOS (2)
    assert _logit_diff(ours, theirs, tokens, tokens, running=[3, 1]) == 0.5
    assert _logit_diff(ours, theirs, tokens, tokens, running=[3, 3]) == 9.0


def test_logit_diff_stops_where_the_tokens_part():
    ours = [np.zeros((1, 2)), np.zeros((1, 2)), np.ones((1, 2))]
    theirs = [np.zeros((1, 2))] * 3
    assert _logit_diff(ours, theirs, [[1, 2, 3]], [[1, 5, 3]], running=[3]) == 0.0  # step 2 fed 2 vs 5
    assert _logit_diff(ours, theirs, [[1, 2, 3]], [[1, 2, 3]], running=[3]) == 1.0


def test_skip_check_judges_each_steps_layers_by_the_policy_whatever_the_step_count():
    policy = SkipPolicy(max_layers=6, min_layers=2, horizon=4, num_layers=6)
    steps = [StepStats(g, len(policy.active_layers(g)), tuple(policy.active_layers(g)), 0.01, 6) for g in range(9)]
    assert _layers_follow(steps, policy)  # past the horizon too: as many steps as the row ran
    wrong = steps[:3] + [StepStats(3, 3, (0, 1, 2), 0.01, 6)] + steps[4:]  # lower layers, not the top ones
    assert not _layers_follow(wrong, policy)


def test_step_logits_take_each_rows_from_the_event_of_its_step():
    """An int8/int4 artifact seats its rows one at a time (batch_invariant): its first events carry
    one row each, the others' logits zeros. Each row's logits at step g are those of the event that
    gave its step-g token (read as one event per step, the diff was the largest logit: 41 on the
    real SmolLM2 int4, whose tokens were transformers')."""
    def event(step, tokens, rows):
        logits = np.zeros((2, 3), np.float32)
        for b, value in rows.items():
            logits[b] = value
        return TokenEvent(step, tokens, [""] * 2, [False] * 2, logits)
    stream = [event(0, [5, None], {0: 1.0}), event(0, [None, 6], {1: 2.0}), event(1, [7, 8], {0: 3.0, 1: 4.0})]
    steps = _step_logits(iter(stream), 2)
    assert [s[:, 0].tolist() for s in steps] == [[1.0, 2.0], [3.0, 4.0]]
