# The example jobs' parallel layout, from what this machine has. Sourced after
# env.sh (needs $PY; uses its GPU_COUNT); sets NPROC, TP, DP and TP_FLAGS.
#
#   NPROC  processes on this node. Default: one per GPU that torch sees (NCCL
#          needs a GPU per process), or 4 CPU worker processes (gloo) without one.
#   TP     tensor-parallel size. Default: 2 when NPROC is even, else 1. It must
#          divide NPROC and the model's 4 attention heads (1, 2 or 4).
# DP = NPROC / TP ranks then shard the model with FSDP (one node; for several,
# see scripts/slurm_pretrain_gpt.sbatch).

is_count() { case "$1" in '' | *[!0-9]* | 0*) return 1 ;; esac; }   # 1, 2, ...: no sign, no leading 0
if [ -z "${NPROC:-}" ]; then
  # env.sh's torch probe has counted them already (GPU_COUNT); ask torch only without it.
  GPUS="${GPU_COUNT:-$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')}"
  if [ "$GPUS" -gt 0 ]; then NPROC="$GPUS"; else NPROC=4; fi
fi
if ! is_count "$NPROC"; then
  echo "layout: NPROC=$NPROC must be a positive integer (the processes on this node)" >&2
  exit 2
fi
if [ -z "${TP:-}" ]; then
  if [ $((NPROC % 2)) -eq 0 ]; then TP=2; else TP=1; fi
fi
if ! is_count "$TP" || [ $((NPROC % TP)) -ne 0 ]; then
  echo "layout: TP=$TP must be a positive integer that divides NPROC=$NPROC (the processes on this node)" >&2
  exit 2
fi
DP=$((NPROC / TP))
TP_FLAGS=(--tensor-model-parallel-size "$TP")
if [ "$TP" -gt 1 ]; then TP_FLAGS+=(--sequence-parallel); fi
echo "[layout] $NPROC processes: TP=$TP x FSDP=$DP" >&2
