#!/usr/bin/env bash
# The executor and service path against PyTorch on one GPU, in one session:
# `lanes bench infer` (executor and service paths, then the service path with
# feed buffers and busy polling) for ResNet-50, ResNet-152, Inception-v3 and
# BERT-base at batch 8, `lanes bench train` for a ResNet-50 step at batch 32,
# and benches/torch_ref.py (eager and CUDA-graph replay) for the same; then
# the table (benches/summary.py).
#   scripts/bench_vs_torch.sh [LANES_BIN] [OUT_DIR]
# MODELS, ITERS, BUSY_POLL_MS and TRAIN=0 change what runs.
set -euo pipefail
lanes=${1:-target/release/lanes}
out=${2:-bench-out}
models=${MODELS:-resnet50 resnet152 inception_v3 bert_base}
iters=${ITERS:-30}
busy=${BUSY_POLL_MS:-10}
mkdir -p "$out"
for m in $models; do
  echo "== $m" >&2
  "$lanes" bench infer --model "$m" --batch 8 --device cuda --iters "$iters" --path both \
    > "$out/lanes-infer-$m.json"
  "$lanes" bench infer --model "$m" --batch 8 --device cuda --iters "$iters" --path service \
    --feed-buffers --busy-poll "$busy" > "$out/lanes-infer-$m-buffers.json"
done
if [ "${TRAIN:-1}" = 1 ]; then
  echo "== resnet50 training step" >&2
  "$lanes" bench train --model resnet50 --batch 32 --device cuda --iters "$iters" --path both \
    > "$out/lanes-train-resnet50.json"
  "$lanes" bench train --model resnet50 --batch 32 --device cuda --iters "$iters" --path service \
    --feed-buffers --busy-poll "$busy" > "$out/lanes-train-resnet50-buffers.json"
fi
here=$(dirname "$0")/..
python3 "$here/benches/torch_ref.py" --cuda-graph --models "$(echo "$models" | tr ' ' ',')" \
  --iters "$iters" --warmup 5 > "$out/torch-infer.jsonl"
if [ "${TRAIN:-1}" = 1 ]; then
  python3 "$here/benches/torch_ref.py" --train --iters "$iters" --warmup 5 > "$out/torch-train.jsonl"
fi
python3 "$here/benches/summary.py" "$out"/*.json "$out"/*.jsonl | tee "$out/table.md"
