#!/usr/bin/env bash
# The main job, on any machine, offline: the Python standard library's sources
# as a corpus, Megatron's preprocessing, a small GPT trained with tensor x
# fully-sharded data parallelism until the validation loss falls, then a few
# generated lines from the checkpoint. About 5 minutes on 2 cores.
#
#   bash scripts/pretrain_gpt_stdlib.sh [extra flags for examples/pretrain_gpt.py]
#
# The layout follows the machine (scripts/layout.sh): one process per GPU
# (1 GPU: TP=1 x FSDP=1; 8 GPUs: TP=2 x FSDP=4), or TP=2 x FSDP=2 on 4 CPU
# workers without a GPU; NPROC and TP override it. RUN_DIR (default
# runs/stdlib) holds the corpus, the .bin/.idx files, the index cache and the
# checkpoints; a second run resumes from them.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/layout.sh"
cd "$ROOT"
RUN_DIR="${RUN_DIR:-runs/stdlib}"
# 16 sequences per step, or one micro-batch of 4 per data-parallel rank when more.
GBS=$(( (16 + 4 * DP - 1) / (4 * DP) * 4 * DP ))
TORCHRUN=("$PY" -m torch.distributed.run --nproc-per-node)
TOKENIZER=(--tokenizer-type GPT2BPETokenizer --vocab-file "$RUN_DIR/byte-vocab.json"
           --merge-file "$RUN_DIR/byte-merges.txt")
MODEL=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --swiglu --normalization RMSNorm
       --disable-bias-linear --seq-length 128 --max-position-embeddings 128 --position-embedding-type rope --bf16)

if [ ! -f "$RUN_DIR/stdlib_text_document.idx" ]; then
  "$PY" tools/stdlib_corpus.py --output-dir "$RUN_DIR" --max-megabytes 4
  "$PY" tools/preprocess_data.py --input "$RUN_DIR/stdlib.jsonl" --output-prefix "$RUN_DIR/stdlib" \
    "${TOKENIZER[@]}" --append-eod --workers 2
fi

"${TORCHRUN[@]}" "$NPROC" examples/pretrain_gpt.py --use-torch-fsdp2 "${TP_FLAGS[@]}" "${MODEL[@]}" \
  "${TOKENIZER[@]}" --data-path "$RUN_DIR/stdlib_text_document" --split 90,8,2 --data-cache-path "$RUN_DIR/cache" \
  --micro-batch-size 4 --global-batch-size "$GBS" --train-iters 200 \
  --lr 2e-3 --lr-warmup-iters 20 --lr-decay-style cosine --min-lr 2e-4 \
  --hidden-dropout 0.0 --attention-dropout 0.0 \
  --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 100 \
  --log-interval 20 --log-throughput --eval-interval 50 --eval-iters 5 --seed 1234 "$@"

# Generation at the training TP size (any TP size loads the checkpoint).
"${TORCHRUN[@]}" "$TP" examples/generate_gpt.py --tensor-model-parallel-size "$TP" "${MODEL[@]}" "${TOKENIZER[@]}" \
  --load "$RUN_DIR/checkpoints" \
  --prompts "def __init__(self" "import " --num-tokens-to-generate 80 --top_k 5 --temperature 0.8
