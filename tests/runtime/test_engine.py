"""The engine's scheduler with several requests in flight."""

import threading

from tests.conftest import PROMPTS


def _drain_within(stream, seconds: float = 60) -> int:
    """Events of ``stream``, read on a daemon thread: a dead engine fails the test, not hangs it."""
    counted = []
    reader = threading.Thread(target=lambda: counted.append(len(list(stream))), daemon=True)
    reader.start()
    reader.join(seconds)
    assert counted, f"no result within {seconds} s: the engine thread stopped"
    return counted[0]


def test_a_later_request_may_finish_first(generator):
    """Requests end in any order: the scheduler removes them from its lists by identity (a
    field-wise == on their numpy arrays raised and stopped the engine thread, and every stream
    then waited forever)."""
    long = generator.stream(PROMPTS[0], 12, ignore_eos=True)
    short = generator.stream(PROMPTS[1], 2, ignore_eos=True)
    assert _drain_within(short) == 2
    assert _drain_within(long) == 12
    assert short.result.finish_reasons == long.result.finish_reasons == ["length"]
    assert generator.generate(PROMPTS[2], 3).token_ids  # the engine still runs
