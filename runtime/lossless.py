"""How many tokens a lossless row drafts before each verify pass, and when it stops drafting.

Lossless decoding (runtime.engine): a row drafts k tokens with its policy's layers, then one
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
"""

from __future__ import annotations

from dataclasses import dataclass

DRAFT_START = 2  # k of a row's first pass: cheap to lose, grows by 2 a pass
DRAFT_MAX = 16  # the most drafts per pass (a verify pass over 17 tokens)
PAUSE_START = 64  # tokens of plain full depth after the first pass that lost time
PAUSE_MAX = 256


@dataclass
class DraftPlan:
    """One lossless row's drafting: its k, its acceptance, its pauses."""

    k: int = DRAFT_START  # drafts before the next verify pass
    made: int = 0  # drafts verified
    kept: int = 0  # of those, kept
    resume_at: int = 0  # the generation step from which it drafts again
    pause: int = PAUSE_START  # the next pause's length, tokens
    tries_own_set: bool = True  # whether the smallest set's failure leads to the row's own set, not a
    # pause: for a model fine-tuned under SkipDecode (an untuned model's own set drafts no better)
    own_set: bool = False  # drafts run the row's own decaying set, not the policy's smallest (which
    # did not pay)

    def drafting(self, step: int) -> bool:
        return step >= self.resume_at

    def verified(self, made: int, kept: int, pays: bool, step: int) -> None:
        """A pass kept ``kept`` of ``made`` drafts; ``pays``: whether drafting beats full depth for
        the rows this pass verified (``pays_off``); the row's next token is step ``step``'s."""
        self.made, self.kept = self.made + made, self.kept + kept
        if pays:  # the row's runs of kept drafts choose its k
            self.k = min(self.k + 2, DRAFT_MAX) if kept == made else max(1, self.k - 1)
            return
        if self.tries_own_set and not self.own_set:  # the smallest set's drafts lose: its own set's,
            # judged afresh
            self.own_set, self.k, self.made, self.kept = True, DRAFT_START, 0, 0
            return
        self.resume_at, self.pause = step + self.pause, min(2 * self.pause, PAUSE_MAX)
        self.k = 1
        self.made, self.kept = self.made // 2, self.kept // 2  # what comes after the pause weighs more


def pays_off(plans: list[DraftPlan], made: int, kept: int, r: float, v: float) -> bool:
    """Whether some pass length beats full-depth steps for the rows of ``plans``, whose pass just
    kept ``kept`` of ``made`` drafts (one pass verifies them all, so they are judged together):
    their drafts' acceptance against a draft step's time ``r`` and a verify pass's ``v``, in
    full-depth steps."""
    made += sum(p.made for p in plans)
    kept += sum(p.kept for p in plans)
    return best_draft(kept, made, r, v) > 0


def best_draft(kept: int, made: int, r: float, v: float) -> int:
    """The pass length giving the most tokens per full-depth step's time, 0 when plain full-depth
    steps are at least as fast: ``kept`` of ``made`` drafts kept so far, ``r`` a draft
    step's and ``v`` a verify pass's time in full-depth steps."""
    a = (kept + 0.5) / (made + 1)  # half a kept draft as the prior
    best_k, best = 0, 1.0
    for k in range(1, DRAFT_MAX + 1):
        tokens = k + 1 if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
        speed = tokens / (k * r + v)
        if speed > best:
            best_k, best = k, speed
    return best_k


__all__ = ["DRAFT_MAX", "DRAFT_START", "DraftPlan", "PAUSE_MAX", "PAUSE_START", "best_draft", "pays_off"]
