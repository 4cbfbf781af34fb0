"""Lossless decoding (self-speculative): the drafting, the verify rule, k and pauses.

runtime.engine runs it: a row drafts k tokens with its policy's layers, then one
full-depth pass over them keeps the agreeing prefix and full depth's own next token. Whether that
beats plain full-depth steps depends on the model and the text, so each row measures it: the
drafts' acceptance a (kept / made, with half a kept draft of one as the prior), a draft step's time r and a
verify pass's time v, both in full-depth steps. If each draft is kept with probability a, a pass of
k drafts gives (1 - a^(k+1)) / (1 - a) tokens in k r + v steps' time. While some k beats full depth
(the rows one pass verifies are judged together: the pass costs the same whichever of them drafted
well), each row's k follows its runs of kept drafts (+2 after a pass that kept all, -1 after one
that did not). A row drafts first at its policy's smallest active set (the cheapest: every verify
pass leaves every layer's K/V complete, so drafts need not decay); when no k beats full depth
there, a model fine-tuned under the policy drafts at the row's own decaying set instead, the one
it was trained on at that step (a model trained on a long horizon and short texts never ran the
smallest set), its counts started afresh; an untuned model, whose own set drafts no better than
its smallest, skips this trial. When no k beats full depth at the set it drafts with, the rows
pause: plain full-depth steps for ``PAUSE_START`` tokens, then it drafts again (k = 1), each pause
twice the last (up to ``PAUSE_MAX``) and its counts halved, so a model that drafts badly costs a
pass now and then, and one that drafts well again (another part of the text) is found again.

Its parts: ``plan`` (a row's k and pauses, ``pays_off``), ``drafts`` (a row's drafts between two
passes, ``DraftState``, and how a draft token is chosen), ``verify`` (speculative sampling's rule
for a sampled row's draft).
"""

from .drafts import DraftState, next_draft
from .plan import DRAFT_MAX, DRAFT_START, PAUSE_MAX, PAUSE_START, DraftPlan, best_draft, pays_off
from .verify import verify_draft

__all__ = ["DRAFT_MAX", "DRAFT_START", "DraftPlan", "DraftState", "PAUSE_MAX", "PAUSE_START", "best_draft",
           "next_draft", "pays_off", "verify_draft"]
