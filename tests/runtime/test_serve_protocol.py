"""runtime.serve without a live server: the protocol's pieces and the package's import cost."""

import subprocess
import sys
from pathlib import Path

import pytest

from runtime.serve.protocol import RequestError, StopHoldback, parse_completion

REPO = Path(__file__).resolve().parents[2]


def test_stop_holdback_never_streams_part_of_a_stop():
    h = StopHoldback(["\n\n", "END"])
    assert h.push("ab\n") == "ab"  # "\n" may start "\n\n"
    assert h.push("c") == "\nc"  # it did not
    assert h.push("EN") == ""
    assert h.finish("D", "stop") == ""  # the stop string is never sent
    assert h.text == "ab\ncEND"
    h = StopHoldback(["END"])
    assert h.push("xE") == "x" and h.finish("N", "length") == "EN"  # max_tokens: the text stays


def test_import_runtime_stays_light():
    code = ("import sys, runtime; heavy = [m for m in ('starlette', 'uvicorn', 'httpx', 'anyio', 'prometheus_client', 'jinja2', 'ray') "
            "if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_defaults_are_openai_and_greedy_is_temperature_0():
    req = parse_completion({"prompt": "hi"}, "m", max_batch=8)
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.stream) == (16, 1.0, 1.0, 0, False)
    assert req.generation_config().do_sample is True
    greedy = parse_completion({"prompt": "hi", "temperature": 0}, "m", max_batch=8, default_speedup=2)
    assert greedy.generation_config().do_sample is False and greedy.speedup == 2.0


def test_bool_is_not_a_number():
    with pytest.raises(RequestError) as info:
        parse_completion({"prompt": "hi", "max_tokens": True}, "m", max_batch=8)
    assert info.value.param == "max_tokens" and info.value.status == 400


def test_policy_object_takes_the_decay_shape_and_generates_as_generate_does(generator):
    policy = {"max_layers": 5, "min_layers": 2, "decay": "power", "exponent": 2.0, "prefill": "policy"}
    req = parse_completion({"prompt": "hi", "temperature": 0, "policy": policy}, "m", max_batch=8)
    assert req.policy == policy
    ours = generator.generate(["hello there"], 6, config=req.generation_config(), stop_strings=None)
    chosen = generator.policy_for(6, policy=policy)
    assert (chosen.decay, chosen.exponent, chosen.prefill) == ("power", 2.0, "policy")
    assert ours.token_ids == generator.generate(["hello there"], 6, policy=chosen).token_ids
    with pytest.raises(RequestError) as info:
        parse_completion({"prompt": "hi", "policy": {"max_layers": 5, "min_layers": 2, "shape": 1}}, "m",
                         max_batch=8)
    assert info.value.param == "policy.shape"


def test_the_stop_string_and_what_follows_it_in_its_token_are_cut():
    """The runtime's text runs to the end of the token that completed the stop string; OpenAI's is
    the text before it."""
    from runtime.serve.protocol import cut_stop

    assert cut_stop("The Eagle.\n\nname", ["\n\n", "zz"]) == "The Eagle."
    assert cut_stop("no stop here", ["zz"]) == "no stop here"
    h = StopHoldback(["END"])
    assert h.push("ab") == "ab" and h.finish("c END. more", "stop") == "c "
