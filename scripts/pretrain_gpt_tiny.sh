#!/usr/bin/env bash
# A minute's GPT pretraining run on mock data: tensor-parallel x fully-sharded
# data-parallel (TorchFullyShardedDataParallel), laid out by scripts/layout.sh
# (TP=2 x FSDP=2 on 4 CPU workers, or one process per GPU). Extra arguments
# are passed to examples/pretrain_gpt.py and override the defaults below.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/layout.sh"
cd "$ROOT"
GBS=$(( (16 + 4 * DP - 1) / (4 * DP) * 4 * DP ))
exec "$PY" -m torch.distributed.run --nproc-per-node "$NPROC" examples/pretrain_gpt.py \
  --use-torch-fsdp2 "${TP_FLAGS[@]}" \
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
  --seq-length 32 --max-position-embeddings 32 --position-embedding-type rope \
  --micro-batch-size 4 --global-batch-size "$GBS" \
  --lr 3e-3 --lr-warmup-iters 5 --lr-decay-style cosine --min-lr 3e-4 --train-iters 60 \
  --hidden-dropout 0.0 --attention-dropout 0.0 \
  --mock-data --vocab-size 128 --log-interval 5 --log-throughput --eval-interval 20 --eval-iters 2 \
  --seed 1234 "$@"
