"""A lossless row's k and pauses: how many tokens it drafts before each verify pass, and when
it stops drafting (the package's docstring says why)."""

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

