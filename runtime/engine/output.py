"""The output: each row's next token chosen (penalties, the JSON mask, a judged draft), detokenized,
checked against the stop strings, and streamed as one event per request and step; a request's
result."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ..decoding.sampling import penalize, probabilities, select, token_logprob
from ..lossless import verify_draft
from ..stats import GenerationResult, TokenEvent
from .state import Request, Sequence


def emit_step(r: Request, g: int, members: list[Sequence], release: Callable[[int], None]) -> None:
    """Step ``g``'s tokens of ``members``, rows of ``r``: selected, detokenized, streamed; a row that
    ends gives its KV row back (``release``)."""
    last = g == r.max_new_tokens - 1
    B = r.rows
    logits = None  # (B, V): the event's, built only for a request that streams them
    if r.streams and r.logits and len(members) == 1 == B:  # a request of one row: its row of the step's logits
        logits = members[0].logits[None, :]  # (1, V), no copy: every backend's logits are fresh arrays
    elif r.streams and r.logits:  # rows that have finished stream zeros
        logits = np.zeros((B, members[0].logits.shape[0]), np.float32)
        for s in members:
            logits[s.index] = s.logits
    event = TokenEvent(g, [None] * B, [""] * B, [False] * B, logits, [None] * B,
                       None if r.logprobs is None else [None] * B)
    for s in members:
        b = s.index
        detok, before = r.detok[b], s.text
        # the logits' argmax the backend picked (Request.argmax_only), or a choice from the logits
        token = s.chosen if s.chosen is not None else choose(s, r)
        complete = s.matcher is not None and token not in r.eos and s.matcher.consume(token)
        if r.logprobs is not None:
            event.logprobs[b] = token_logprob(s.logits, token, r.logprobs)
            r.token_logprobs[b].append(event.logprobs[b])
        delta = detok.add(token)
        if token in r.eos or last or complete:
            delta += detok.flush()
        text = before + delta
        hit = first_stop(text, r.stops, len(before))
        if hit is not None:  # the whole last token stays, so that text == decode(token_ids)
            text += detok.flush()
        event.token_ids[b], event.texts[b] = token, text[len(before):]
        s.text, s.token, s.logits, s.chosen = text, token, None, None
        if s.copy is not None:  # the next step runs deep while the text copies the prompt
            s.copy.due = s.copy.rule.due(text)
        reason = ("eos" if token in r.eos else "stop" if hit is not None or complete
                  else "length" if last else None)
        if reason is not None:
            s.reason = event.finish_reasons[b] = reason
            if s.row >= 0:
                release(s.row)
    event.finished = [s.reason is not None for s in r.seqs]
    r.stats.new_tokens = max(r.stats.new_tokens, g + 1)
    if g == 0 and not r.stats.first_token_seconds:
        r.stats.first_token_seconds = time.perf_counter() - r.created
    if g > 0:  # a decode step's (or verify pass's) tokens, not the prompt's
        r.stats.decode_tokens += len(members)
    r.step_times.append(time.perf_counter())
    if r.streams:
        r.events.put(event)


def choose(s: Sequence, r: Request) -> int:
    """Row ``s``'s next token from its logits: penalties, the JSON mask, a judged draft, sampling."""
    scores = penalize(s.logits, r.detok[s.index].tokens, r.sampling) if r.sampling.penalized else s.logits
    if s.matcher is not None and (r.sampling.do_sample or not s.matcher.allows(int(scores.argmax()))):
        scores = s.matcher.mask(scores)  # only what keeps the text on its schema
    if s.draft is not None and s.draft.proposal is not None and r.sampling.do_sample:  # a draft judged
        draft, q = s.draft.proposal
        return verify_draft(probabilities(scores[None, :], r.sampling)[0], draft, q, s.rng)
    # greedy: full depth's argmax, which the verify pass compares with the draft
    return int(select(scores[None, :], r.sampling, s.rng)[0])


def result(r: Request, unfinished: str | None = None) -> GenerationResult:
    """The request's result: each row's text and tokens so far, and why it ended (``unfinished``
    for a row still running: "cancelled")."""
    r.stats.seconds = time.perf_counter() - r.created
    return GenerationResult([s.text for s in r.seqs], [d.tokens for d in r.detok], r.stats, r.policy,
                            [s.reason or unfinished for s in r.seqs], r.token_logprobs)


def first_stop(text: str, stops: list[str], new_from: int = 0) -> int | None:
    """End index of the earliest stop string in ``text`` (the row ends at the token that completes it).

    Only matches that end after ``new_from`` (the text before it was searched at earlier steps)
    are looked for, so a step searches a bounded tail, not the whole text.
    """
    ends = []
    for s in stops:
        if s:
            found = text.find(s, max(new_from - len(s) + 1, 0))
            if found >= 0:
                ends.append(found + len(s))
    return min(ends) if ends else None
