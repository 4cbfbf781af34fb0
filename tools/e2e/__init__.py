"""The E2E recipes' steps: ``python -m tools.e2e init`` (the demo model), ``distill`` and ``consensus``
(fine-tuning targets: the model's own faithful descriptions; one faithful description per MR closest
to its other references, models/smollm2-135m-e2e) and ``split`` (a by-MR split of a pairs file, no
longer used by the recipes).

The whole recipe (tokenizer + random init, full-depth training, SkipDecode fine-tuning, on the
official E2E training split with checkpoints selected on the development split) is
tools/e2e/recipe.sh; models/opt-e2e-skipdecode/README.md is the model card.
"""
