"""The E2E demo model's recipe steps: ``python -m tools.e2e init`` (and ``split``, a by-MR split of a
pairs file, no longer used by the recipe).

The whole recipe (tokenizer + random init, full-depth training, SkipDecode fine-tuning, on the
official E2E training split with checkpoints selected on the development split) is
tools/e2e/recipe.sh; models/opt-e2e-skipdecode/README.md is the model card.
"""
