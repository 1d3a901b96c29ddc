#!/usr/bin/env bash
# The README experiment: a small ViT on Fashion-MNIST, on this machine's CPU.
#   dense E epochs | capskip E epochs | dense time-matched to capskip's wall-clock |
#   random with capskip's per-step kept counts | SB (fixed count) at capskip's mean keep rate | Stale-SB |
#   UB (its defaults) | VCAS alone | CAPSkip then VCAS inside its kept rows (VCAS_FREQ="" skips these two);
# SEEDS seeds each, then one compare table + plots in $OUT/compare.  capskip's b: BUDGET, or (unset) the
# largest of BUDGETS within TOL points of dense on VAL validation rows over SELECT_SEEDS ($OUT/select.md).
# Finished runs (with result.json) are skipped, so the script can be resumed; FORCE=1 reruns.  Two copies
# started side by side (one per core) share the runs: each run is locked by the copy running it.
# ONLY="vcas ub" runs only the runs whose names start with one of those words (the time-matched and SB
# runs need capskip's result).
#
#   E=2 TRAIN_SUBSET=2000 EVAL_SUBSET=500 SEEDS="0" experiments/run_main.sh   # a quick look
set -euo pipefail

E=${E:-10}                          # epochs
TRAIN_SUBSET=${TRAIN_SUBSET:-10000} # images per epoch ("none" = all 60000)
EVAL_SUBSET=${EVAL_SUBSET:-2000}
SEEDS=${SEEDS:-"0 1 2"}
BUDGET=${BUDGET:-}                  # capskip's b (also the matched rule's b for random); empty: chosen on validation
SELECT_SEEDS=${SELECT_SEEDS:-"100 101 102"}  # seeds of the budget choice (not comparison seeds)
BUDGETS=${BUDGETS:-"0.1 0.3 0.5 0.7"}
VAL=${VAL:-2000}                    # validation rows held out of the training split for the choice
TOL=${TOL:-0.5}                     # the largest b whose mean validation top-1 is within TOL of dense's
SB_KEEP=${SB_KEEP:-}                # empty: capskip's measured kept fraction, same seed
BACKEND=${BACKEND:-inductor}
CONFIG=${CONFIG:-configs/fashion_mnist_tiny.yaml}
OUT=${OUT:-runs/main}
VCAS_FREQ=${VCAS_FREQ-16}           # VCAS probe period (~steps/50, the reference's advice); empty: no VCAS runs
EXTRA=${EXTRA:-}                    # flags for every run, e.g. "--threads 2 --device cpu"
PY=${PYTHON:-python}

cd "$(dirname "$0")/.."
# shellcheck source=experiments/locks.sh
source experiments/locks.sh

run() {  # run NAME FLAGS...
  local name=$1; shift
  if [[ -n "${ONLY:-}" ]]; then
    local w keep_it=""
    for w in $ONLY; do [[ "$name" == "$w"* ]] && keep_it=1; done
    [[ -n "$keep_it" ]] || return 0
  fi
  if [[ -f "$OUT/$name/result.json" && -z "${FORCE:-}" ]]; then
    echo "== $name: done, skipping"; return
  fi
  echo "== $name"
  # shellcheck disable=SC2086  # EXTRA is a list of flags
  locked "$OUT/.locks/$name.lock" "$PY" -m capskip_fx.train --config "$CONFIG" --epochs "$E" \
    --train-subset "$TRAIN_SUBSET" --eval-subset "$EVAL_SUBSET" --backend "$BACKEND" --out "$OUT/$name" $EXTRA "$@"
}

result() {  # result RUN KEY
  "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$OUT/$1/result.json" "$2"
}

# capskip's budget, chosen on validation rows over the selection seeds (the test set is not looked at)
if [[ -z "$BUDGET" ]]; then
  for s in $SELECT_SEEDS; do
    ONLY="" run "select/dense-s$s" --rule dense --val-split "$VAL" --seed "$s"
    for b in $BUDGETS; do
      ONLY="" run "select/capskip-b$b-s$s" --rule capskip --budget "$b" --val-split "$VAL" --seed "$s"
    done
  done
  # shellcheck disable=SC2046
  wait_for $(for s in $SELECT_SEEDS; do echo "$OUT/select/dense-s$s"; for b in $BUDGETS; do echo "$OUT/select/capskip-b$b-s$s"; done; done)
  # shellcheck disable=SC2086  # lists of words
  BUDGET=$("$PY" -m capskip_fx.train choose-budget "$OUT/select" --seeds $SELECT_SEEDS --budgets $BUDGETS \
    --tol "$TOL" --out "$OUT/select.md")
  echo "== capskip budget chosen on validation: b=$BUDGET (see $OUT/select.md)"
fi

for s in $SEEDS; do
  run "dense-s$s" --rule dense --seed "$s"
  run "capskip-b$BUDGET-s$s" --rule capskip --budget "$BUDGET" --seed "$s"
  [[ -d "$OUT/capskip-b$BUDGET-s$s" ]] && wait_for "$OUT/capskip-b$BUDGET-s$s"  # another copy may be running it
  wall=$(result "capskip-b$BUDGET-s$s" wall_clock_s 2>/dev/null || true)  # empty under ONLY without capskip
  keep=${SB_KEEP:-$(result "capskip-b$BUDGET-s$s" kept_frac 2>/dev/null || true)}
  run "dense-timematched-b$BUDGET-s$s" --rule dense --time-budget "$wall" --seed "$s"
  run "random-matched-b$BUDGET-s$s" --rule random --match capskip --budget "$BUDGET" --seed "$s"
  # SB at capskip's rate on every step: Composer's draw, its window opened to the whole run
  run "sb-b$BUDGET-s$s" --rule sb --keep "$keep" --rule-opt start=0 --rule-opt end=1 --rule-opt interrupt=0 \
    --label "sb (capskip's keep rate)" --seed "$s"
  run "stale-sb-s$s" --rule stale_sb --seed "$s"  # the loader's filter skips forwards too
  run "ub-s$s" --rule ub --seed "$s"
  if [[ -n "$VCAS_FREQ" ]]; then
    run "vcas-s$s" --rule vcas --vcas-opt freq="$VCAS_FREQ" --seed "$s"
    run "capskip-vcas-b$BUDGET-s$s" --rule capskip --budget "$BUDGET" --vcas-opt freq="$VCAS_FREQ" --seed "$s"
  fi
done

wait_unlocked "$OUT/.locks"  # the runs another copy is still making
"$PY" -m capskip_fx.train compare "$OUT"/*-s*/ --out "$OUT/compare"  # the comparison runs, not select/
