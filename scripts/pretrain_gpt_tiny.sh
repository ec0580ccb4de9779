#!/usr/bin/env bash
# The main job: a small GPT pretraining run, tensor-parallel 2 x fully-sharded
# data-parallel 2 (TorchFullyShardedDataParallel), on 4 CPU worker processes
# (or 4 GPUs when present). Extra arguments are
# passed to examples/pretrain_gpt.py and override the defaults below.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
NPROC="${NPROC:-4}"
exec "$PY" -m torch.distributed.run --nproc-per-node "$NPROC" examples/pretrain_gpt.py \
  --use-torch-fsdp2 --tensor-model-parallel-size 2 --sequence-parallel \
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
  --seq-length 32 --max-position-embeddings 32 --position-embedding-type rope \
  --micro-batch-size 4 --global-batch-size 16 \
  --lr 3e-3 --lr-warmup-iters 5 --lr-decay-style cosine --min-lr 3e-4 --train-iters 60 \
  --hidden-dropout 0.0 --attention-dropout 0.0 \
  --mock-data --vocab-size 128 --log-interval 5 --log-throughput --eval-interval 20 --eval-iters 2 \
  --seed 1234 "$@"
