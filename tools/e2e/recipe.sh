#!/usr/bin/env bash
# The demo model, end to end: models/opt-e2e-skipdecode (see its README.md, the model card).
# CPU is enough (2 cores, measured: 25 min for step 2, 5-7 min per run of step 3); a GPU is used when present.
# Intermediate checkpoints go to .work/ (git-ignored). Each stage resumes with --resume if cut off.
set -euo pipefail
cd "$(dirname "$0")/../.."
DATA=${E2E_DEVSET:-../shared/data/e2e/devset.csv}
COLS=(--prompt-column mr --target-column ref)
HORIZON=32  # decode steps the budget decays over: about the median description (27 tokens + EOS)

# 1. split the E2E devset by meaning representation (committed as data/e2e/{train,val}.csv)
[ -f data/e2e/train.csv ] || python -m tools.e2e split --data "$DATA" --out data/e2e
# 2. BPE tokenizer on the training text + a random 12-layer OPT, trained at full depth
python -m tools.e2e init --train data/e2e/train.csv --out .work/e2e-init
python -m tools.finetune --model .work/e2e-init --train data/e2e/train.csv --val data/e2e/val.csv \
    "${COLS[@]}" --out .work/e2e-base --epochs 30 --lr 1e-3 --horizon $HORIZON --checkpoint-every 1000
# 3. SkipDecode fine-tuning: every row draws one of the 1x-5x policies, so one model serves them all
python -m tools.finetune --model .work/e2e-base --train data/e2e/train.csv --val data/e2e/val.csv \
    "${COLS[@]}" --out .work/e2e-skip --speedups 1 2 3 4 5 --epochs 6 --lr 3e-4 --horizon $HORIZON --checkpoint-every 1000
# the model card's comparison: one policy per run (5x only), same budget of steps
python -m tools.finetune --model .work/e2e-base --train data/e2e/train.csv --val data/e2e/val.csv \
    "${COLS[@]}" --out .work/e2e-skip5 --speedups 5 --epochs 6 --lr 3e-4 --horizon $HORIZON --checkpoint-every 1000
# 4. ship the weights and tokenizer (not the checkpoints) beside the model card
mkdir -p models/opt-e2e-skipdecode
cp .work/e2e-skip/{config.json,generation_config.json,model.safetensors,skipdecode.json,tokenizer.json,tokenizer_config.json} \
   models/opt-e2e-skipdecode/
