#!/usr/bin/env bash
# Issue 34's case: 2 training jobs and 4 inference jobs on one GPU, then
# spread over two (one `lanes serve` per GPU), through `lanes bench gpus`.
# Prints one JSON object: each arrangement's training and inference
# samples per second, the ratios spread / one, and `ratio` (the smaller;
# the goal is at least 1.9).
#
#   benches/two_gpus.sh                 # the measurement: GPUs 0 and 1
#   benches/two_gpus.sh --gpus 2,3      # two other GPUs
#   benches/two_gpus.sh --cpu           # a check that it runs (CPU backend, tiny models)
#
# Other arguments go to `lanes bench gpus` (see `lanes bench gpus --help`),
# e.g. --seconds 30 --policy fair --serve-arg=--memory=30GiB.
# LANES (default target/release/lanes) names the binary.
set -euo pipefail
LANES="${LANES:-$(dirname "$0")/../target/release/lanes}"
if [[ "${1:-}" == "--cpu" ]]; then
    shift
    exec "$LANES" bench gpus --device cpu \
        --train-model mlp --train-batch 8 --infer-model mlp --infer-batch 4 \
        --warmup 1 --seconds 1 --serve-arg=--workers=1 --serve-arg=--memory=256MiB "$@"
fi
# The defaults of `lanes bench gpus` are the measurement's: GPUs 0,1,
# resnet18_cifar training at batch 128, resnet50 inference at batch 8,
# 20 s per arrangement, policy priority.
exec "$LANES" bench gpus --device cuda "$@"
