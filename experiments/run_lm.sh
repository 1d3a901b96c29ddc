#!/usr/bin/env bash
# A demonstration of the sequence path, not evidence: a tiny causal LM (transformers Llama, 2 x 64, byte
# tokens) trained from scratch on the Python standard library's source (--task lm --dataset pytext:
# offline, nothing downloaded), a row being a sequence of SEQ_LEN bytes.  Per seed: dense | capskip b |
# SB at capskip's keep rate | random at capskip's per-step counts.  Writes compare.md (top-1 is next-byte
# accuracy) and lm.md (eval loss, perplexity and kept fraction per epoch, mean over seeds) to RESULTS.
#
#   experiments/run_lm.sh                      # 3 seeds, a few minutes on 2 CPU cores
#   SEEDS=0 EPOCHS=1 experiments/run_lm.sh     # a quick look
set -euo pipefail

SEEDS=${SEEDS:-"0 1 2"}
EPOCHS=${EPOCHS:-4}
B=${B:-0.5}
MODEL=${MODEL:-llama}  # untied head: the exact check measures the bound itself (tied GPT-2: it also counts the embedding's gradient)
SEQ_LEN=${SEQ_LEN:-64}
TRAIN=${TRAIN:-4000}
BACKEND=${BACKEND:-inductor}
OUT=${OUT:-runs/lm}
RESULTS=${RESULTS:-experiments/results/lm}
EXTRA=${EXTRA:-}
PY=${PYTHON:-python}
cd "$(dirname "$0")/.."

run() {  # run DIR FLAGS...
  local dir=$1; shift
  if [[ -f "$dir/result.json" && -z "${FORCE:-}" ]]; then echo "== $dir: done, skipping"; return; fi
  echo "== $dir"
  # shellcheck disable=SC2086
  "$PY" -m capskip_fx.train --task lm --dataset pytext --model "$MODEL" --depth 2 --embed-dim 64 --num-heads 2 \
    --seq-len "$SEQ_LEN" --train-subset "$TRAIN" --eval-subset 500 --epochs "$EPOCHS" --batch-size 32 --lr 3e-3 \
    --warmup-epochs 0.25 --backend "$BACKEND" --check-every 25 --out "$dir" $EXTRA "$@"
}
for s in $SEEDS; do
  run "$OUT/runs/dense-s$s" --rule dense --seed "$s"
  run "$OUT/runs/capskip-s$s" --rule capskip --budget "$B" --seed "$s"
  keep=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["kept_frac"])' "$OUT/runs/capskip-s$s/result.json")
  run "$OUT/runs/sb-s$s" --rule sb --keep "$keep" --rule-opt start=0 --rule-opt end=1 --rule-opt interrupt=0 \
    --label "sb (capskip's keep rate)" --seed "$s"
  run "$OUT/runs/random-matched-s$s" --rule random --match capskip --budget "$B" --seed "$s"
done
"$PY" -m capskip_fx.train compare "$OUT/runs" --out "$RESULTS"
"$PY" - "$OUT/runs" "$RESULTS/lm.md" <<'PYEOF'
import csv, math, statistics, sys
from collections import defaultdict
from pathlib import Path
root, out = Path(sys.argv[1]), Path(sys.argv[2])
groups = defaultdict(list)
for d in sorted(root.iterdir()):
    if (d / "summary.csv").exists():
        groups[d.name.rsplit("-s", 1)[0]].append(list(csv.DictReader(open(d / "summary.csv"))))
lines = ["# Tiny causal LM on the Python standard library (byte tokens): eval loss, perplexity, kept fraction",
         "", "Mean over seeds per epoch; perplexity = exp(eval loss per byte). A demonstration of the sequence "
         "path (a row is a sequence), not evidence.", ""]
for name, runs in groups.items():
    lines += [f"## {name} (n = {len(runs)} seeds)", "", "| epoch | eval loss | perplexity | next-byte top-1 (%) | kept |",
              "|---|---|---|---|---|"]
    for e in range(min(len(r) for r in runs)):
        loss = statistics.fmean(float(r[e]["eval_loss"]) for r in runs)
        top1 = statistics.fmean(float(r[e]["eval_top1"]) for r in runs)
        kept = statistics.fmean(float(r[e]["mean_kept_frac"]) for r in runs)
        lines.append(f"| {e + 1} | {loss:.4f} | {math.exp(loss):.2f} | {top1:.2f} | {kept:.3f} |")
    lines.append("")
out.write_text("\n".join(lines))
print(f"written {out}")
PYEOF
mkdir -p "$RESULTS/runs"
for d in "$OUT"/runs/*/; do
  n=$(basename "$d"); mkdir -p "$RESULTS/runs/$n"
  cp "$d"/{result.json,summary.csv,config.yaml,steps.jsonl,checks.jsonl} "$RESULTS/runs/$n/" 2>/dev/null || true
done
