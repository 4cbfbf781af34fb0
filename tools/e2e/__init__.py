"""The E2E demo model's recipe steps: ``python -m tools.e2e split`` and ``python -m tools.e2e init``.

The whole recipe (split, tokenizer + random init, full-depth training, SkipDecode fine-tuning) is
tools/e2e/recipe.sh; models/opt-e2e-skipdecode/README.md is the model card.
"""
