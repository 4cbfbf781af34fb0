"""Continuous batching with per-row SkipDecode budgets, one synchronous step at a time.

``Engine.step()`` is one scheduling round: admit waiting rows into free rows of the KV cache, run
one chunk of the joining request's prompt (the prefill: at full depth, or at the first step's
active set when the policy says ``prefill="policy"``), then one decode step of every row that
decodes, one token each. A row leaves when it finishes and its KV row is reused at once. Nothing
in it starts a thread: an embedded app's control loop drives it through ``Stepper``
(runtime/generator.py), and ``Generator.generate``/``stream`` drive it from one worker thread that
calls the same ``step()`` while there is work.

Rows, not requests, are what the cache holds: each prompt of a call is a ``Sequence`` with its own
step g, token and random stream, so a call of more prompts than rows runs its rows as rows free
up, and each row's tokens are those of its prompt run alone. The rows of one call that are
admitted together prefill together.

Per-row budgets (docs/design.md section 1, "Per-row budgets"): each row keeps its own policy
and its own step g, so its active set is ``policy.active_layers(g)``, whatever the other rows do.
The sets are nested (warm-up layers plus a top block), so a step runs the union of the rows' sets,
layer by layer, and each layer updates exactly the rows whose set holds it; the others pass their
hidden state through unchanged. A row never runs a layer it skipped at an earlier step (its budget
only shrinks), so every layer it runs holds its complete past.

Chunked prefill: while other rows decode, a joining prompt runs a chunk of its tokens per round,
so a running row waits at most one chunk between two tokens (as vLLM's chunked prefill,
Sarathi-Serve); with nothing decoding, the prompt runs whole. ``prefill_chunk`` is the chunk in
tokens, or "auto": chunks sized so that one takes about ``AUTO_STALL`` decode steps, from a fit of
the recent chunks' times as a fixed cost (every layer's call and weight read) plus a cost per token
(``ChunkCosts``; the right T differs by orders of magnitude between a 2-core CPU and a GPU), and a
prompt that would take at most ``AUTO_WHOLE`` such budgets runs whole.
"""

from .core import Engine
from .scheduler import AUTO, AUTO_MIN, AUTO_WHOLE, ChunkCosts
from .state import DONE, EngineClosedError, QueueFullError, Request, Sequence

__all__ = ["AUTO", "AUTO_MIN", "AUTO_WHOLE", "ChunkCosts", "DONE", "Engine", "EngineClosedError",
           "QueueFullError", "Request", "Sequence"]
