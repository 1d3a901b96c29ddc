#!/usr/bin/env bash
# Collect what experiments/run_finetune_tuned.sh has finished so far into its RESULTS folder, while it runs or
# after it stopped: the per-run files (no checkpoints), the validation tables of the grids (partial ones say
# so and choose nothing) and compare.md with its time-to-accuracy figure.  Reads only finished runs.
#
#   experiments/collect_finetune_tuned.sh          # then: git add experiments/results/finetune_tuned
#   OUT=/tmp/ft RESULTS=/tmp/ft/res experiments/collect_finetune_tuned.sh
set -euo pipefail

SELECT_SEEDS=${SELECT_SEEDS:-"100 101 102"}
LRS=${LRS:-"1e-3 2e-3 4e-3"}
SCHEDS=${SCHEDS:-"cosine truncated linear"}
OUT=${OUT:-runs/finetune_tuned}
RESULTS=${RESULTS:-experiments/results/finetune_tuned}
PY=${PYTHON:-python}

cd "$(dirname "$0")/.."
S=$OUT/select
R=$OUT/runs
mkdir -p "$RESULTS/runs" "$RESULTS/select_runs" "$RESULTS/select"
for d in "$R"/*/ "$S"/*/; do
  [[ -f "$d/result.json" ]] || continue
  n=$(basename "$d"); to=$RESULTS/runs/$n
  [[ $d == "$S"/* ]] && to=$RESULTS/select_runs/$n
  mkdir -p "$to"; cp "$d"/{result.json,summary.csv,config.yaml,steps.jsonl} "$to/" 2>/dev/null || true
done

LR_CONFIGS=$(for lr in $LRS; do echo "lr$lr"; done)
GRID=()
for sched in $SCHEDS; do for lr in $LRS; do for bt in 128 fit; do
  [[ $sched == truncated && $bt == fit ]] && continue
  GRID+=("$sched-lr$lr-b$bt")
done; done; done
table() {  # table GROUP TITLE CONFIGS...: the group's validation table; complete grids choose, partial ones list
  local group=$1 title=$2; shift 2
  ls -d "$S/$group"-*-s* >/dev/null 2>&1 || return 0
  # shellcheck disable=SC2086
  "$PY" -m capskip_fx.train.tuned select "$S" --group "$group" --configs "$@" --seeds $SELECT_SEEDS \
    --out "$RESULTS/select/$group.md" --title "$title" --partial >/dev/null
}
# shellcheck disable=SC2086
table capskip "capskip, learning rate" $LR_CONFIGS
C128=(); for c in "${GRID[@]}"; do [[ $c == *-b128 ]] && C128+=("$c"); done
table2() {  # table2 RULE: the batch-128 table (the headline's choice) and the any-batch one
  table "dense-at-$1" "dense at $1's budget, batch 128: the same compute" "${C128[@]}"
  [[ -f "$RESULTS/select/dense-at-$1.md" ]] || return 0
  "$PY" -m capskip_fx.train.tuned select "$S" --group "dense-at-$1" --configs "${GRID[@]}" --seeds $SELECT_SEEDS \
    --out "$RESULTS/select/dense-at-$1-any-batch.md" --partial >/dev/null \
    --title "dense at $1's budget, any batch (the fit batch forwards and back-propagates more rows a step)"
}
table2 capskip
# shellcheck disable=SC2086
table kabena "KABENA, learning rate" $LR_CONFIGS
table2 kabena
if compgen -G "$RESULTS/select/*.md" >/dev/null; then cat "$RESULTS"/select/*.md > "$RESULTS/select.md"; fi
if compgen -G "$RESULTS/runs/*/result.json" >/dev/null; then
  "$PY" -m capskip_fx.train.tuned compare "$RESULTS/runs" --out "$RESULTS" --speed "$RESULTS/r.json"
fi
echo "finished: $(ls -d "$RESULTS"/runs/*/ 2>/dev/null | wc -l) comparison runs, $(ls -d "$RESULTS"/select_runs/*/ 2>/dev/null | wc -l) validation runs"
