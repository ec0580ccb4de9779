"""Megatron-LM's command-line flags that megatron_fsdp supports, in Megatron-LM's
argument groups, each with a one-line help (`--help` adds its default).

Only the flags themselves live here; what they mean together is checked in
arguments.py, and training/configs.py turns them into configs.
"""

from __future__ import annotations

import argparse


def add_megatron_arguments(parser: argparse.ArgumentParser) -> None:
    for add in (_network_size, _regularization, _initialization, _training, _fusion, _learning_rate,
                _checkpointing, _mixed_precision, _fp8, _distributed, _moe, _validation, _data, _tokenizer,
                _logging, _profiling):
        add(parser)


def _network_size(p) -> None:
    g = p.add_argument_group("network size")
    a = g.add_argument
    a("--num-layers", type=int, required=True, help="transformer layers")
    a("--hidden-size", type=int, required=True, help="transformer hidden size")
    a("--ffn-hidden-size", type=int, default=None,
      help="MLP hidden size (None: 4 x hidden, or Megatron's 8/3 x hidden rounded to 64 with --swiglu)")
    a("--num-attention-heads", type=int, required=True, help="attention heads")
    a("--group-query-attention", action="store_true", help="grouped-query attention (see --num-query-groups)")
    a("--num-query-groups", type=int, default=1, help="key/value groups with --group-query-attention")
    a("--kv-channels", type=int, default=None, help="channels per attention head (None: hidden / heads)")
    a("--seq-length", type=int, required=True, help="tokens per sample")
    a("--max-position-embeddings", type=int, default=None, help="position embeddings (None: --seq-length)")
    a("--position-embedding-type", choices=["learned_absolute", "rope", "none"], default="learned_absolute",
      help="position embedding")
    a("--rotary-percent", type=float, default=1.0, help="share of each head's channels that RoPE rotates")
    a("--rotary-base", type=int, default=10000, help="RoPE base period")
    a("--use-rope-scaling", action="store_true", help="Llama 3.1's RoPE frequency scaling")
    a("--rope-scaling-factor", type=float, default=8.0, help="the factor of --use-rope-scaling")
    a("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm", help="normalization layers")
    a("--norm-epsilon", type=float, default=1e-5, help="normalization epsilon")
    a("--swiglu", action="store_true", help="SwiGLU MLP (gated, SiLU)")
    a("--disable-bias-linear", action="store_true", help="linear layers without biases")
    a("--add-qkv-bias", action="store_true", help="biases on the query, key and value projections (Qwen2)")
    a("--qk-layernorm", action="store_true", help="normalize each head's queries and keys (Qwen3, OLMo 2)")
    a("--untie-embeddings-and-output-weights", action="store_true",
      help="separate input embedding and output layer weights")


def _regularization(p) -> None:
    g = p.add_argument_group("regularization")
    a = g.add_argument
    a("--hidden-dropout", type=float, default=0.1, help="dropout after attention and MLP")
    a("--attention-dropout", type=float, default=0.1, help="dropout of the attention probabilities")
    a("--weight-decay", type=float, default=0.01, help="weight decay (constant style)")
    a("--start-weight-decay", type=float, default=None, help="initial weight decay (linear/cosine style)")
    a("--end-weight-decay", type=float, default=None, help="final weight decay (linear/cosine style)")
    a("--weight-decay-incr-style", choices=["constant", "linear", "cosine"], default="constant",
      help="how weight decay moves from start to end")
    a("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    a("--adam-beta2", type=float, default=0.999, help="Adam beta2")
    a("--adam-eps", type=float, default=1e-8, help="Adam epsilon")
    a("--clip-grad", type=float, default=1.0, help="gradient-norm clipping (0: off)")


def _initialization(p) -> None:
    g = p.add_argument_group("initialization")
    g.add_argument("--seed", type=int, default=1234, help="random seed (each TP rank offsets it as Megatron)")
    g.add_argument("--init-method-std", type=float, default=0.02, help="std of the normal weight initialization")


def _training(p) -> None:
    g = p.add_argument_group("training")
    a = g.add_argument
    a("--micro-batch-size", type=int, default=None, help="samples per microbatch per data-parallel rank (required)")
    a("--global-batch-size", type=int, default=None,
      help="samples per iteration over all ranks (None: micro batch x data-parallel size)")
    a("--rampup-batch-size", nargs=3, type=int, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
      help="grow the global batch from START by INCREMENT over SAMPLES samples")
    a("--decrease-batch-size-if-needed", action="store_true",
      help="shrink the global batch to fit the data-parallel size")
    a("--train-iters", type=int, default=None, help="iterations to train (or --train-samples)")
    a("--train-samples", type=int, default=None, help="samples to train (or --train-iters)")
    a("--skip-train", action="store_true", help="only evaluate")
    a("--finetune", action="store_true", help="load weights only: iteration, optimizer and RNG start afresh")
    a("--recompute-granularity", choices=["full", "selective"], default=None, help="activation recomputation")
    a("--recompute-method", choices=["uniform", "block"], default=None, help="which layers full recomputation covers")
    a("--recompute-num-layers", type=int, default=None, help="layers per recomputed chunk (uniform) or recomputed (block)")
    a("--exit-signal-handler", action="store_true", help="on SIGTERM save a checkpoint and exit 0 on every rank")
    a("--exit-interval", type=int, default=None, help="save and exit after this many iterations")
    a("--exit-duration-in-mins", type=float, default=None, help="save and exit after this many minutes")
    a("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false",
      help="train on through a NaN/inf loss or gradient instead of stopping every rank")


def _fusion(p) -> None:
    # Megatron-LM's fusions are on by default; each one selects Megatron's numerics for that path
    # (tanh GELU for bias+GELU, fp32 RoPE rotation...), see TransformerConfig.
    g = p.add_argument_group("fusion", "Megatron-LM's fusions: each --no-* turns off one that is on by default")
    a = g.add_argument
    a("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false", help="plain masked softmax")
    a("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false", help="exact GELU, bias added apart")
    a("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false", help="unfused SwiGLU")
    a("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false", help="unfused bias+dropout+add")
    a("--no-rope-fusion", dest="apply_rope_fusion", action="store_false", help="RoPE rotation in the input dtype")
    a("--no-persist-layer-norm", action="store_true", help="Megatron's Apex LayerNorm kernel choice (same results)")
    a("--cross-entropy-loss-fusion", action="store_true",
      help="fused cross entropy (off by default, as in Megatron-LM): on CUDA one kernel each way, no fp32 logits")
    a("--cross-entropy-fusion-impl", choices=["native", "te"], default="native",
      help="the fused cross entropy's implementation: native (te, Transformer Engine's, is not available)")


def _learning_rate(p) -> None:
    g = p.add_argument_group("learning rate")
    a = g.add_argument
    a("--lr", type=float, default=None, help="peak learning rate (required)")
    a("--min-lr", type=float, default=0.0, help="learning rate at the end of decay")
    a("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"], default="linear",
      help="decay shape")
    a("--lr-decay-iters", type=int, default=None, help="iterations of decay (None: --train-iters)")
    a("--lr-decay-samples", type=int, default=None, help="samples of decay (None: --train-samples)")
    a("--lr-wsd-decay-style", choices=["linear", "cosine", "exponential", "minus_sqrt"], default="exponential",
      help="shape of WSD's final decay")
    a("--lr-wsd-decay-iters", type=int, default=None, help="iterations of WSD's final decay")
    a("--lr-wsd-decay-samples", type=int, default=None, help="samples of WSD's final decay")
    a("--lr-warmup-iters", type=int, default=0, help="iterations of linear warmup")
    a("--lr-warmup-samples", type=int, default=0, help="samples of linear warmup")
    a("--lr-warmup-fraction", type=float, default=None, help="warmup as a fraction of the decay")
    a("--lr-warmup-init", type=float, default=0.0, help="learning rate at the start of warmup")
    a("--override-opt-param-scheduler", action="store_true", help="the flags' schedule wins over a checkpoint's")
    a("--use-checkpoint-opt-param-scheduler", action="store_true", help="the checkpoint's schedule wins")


def _checkpointing(p) -> None:
    g = p.add_argument_group("checkpointing")
    a = g.add_argument
    a("--save", default=None, help="directory to save checkpoints in")
    a("--load", default=None, help="directory to resume from (its latest checkpoint)")
    a("--save-interval", type=int, default=None, help="iterations between checkpoints")
    a("--ckpt-format", default="torch_dcp", help="checkpoint format (torch_dcp only)")
    a("--async-save", action="store_true",
      help="write checkpoints in the background: training stalls only while the state is copied to CPU memory")
    a("--use-persistent-ckpt-worker", action="store_true",
      help="(Megatron-LM's companion of --async-save, implied by it: the background writer lives for the run)")
    a("--no-load-optim", action="store_true", help="do not load the optimizer state")
    a("--no-load-rng", action="store_true", help="do not load the RNG states")
    a("--exit-on-missing-checkpoint", action="store_true", help="stop when --load holds no checkpoint")
    a("--no-verify-checkpoint", action="store_true", help="skip the checksum check when loading")
    a("--use-checkpoint-args", action="store_true",
      help="the model flags stored in --load's checkpoint override the command line's")


def _mixed_precision(p) -> None:
    g = p.add_argument_group("mixed precision")
    a = g.add_argument
    a("--bf16", action="store_true", help="bf16 compute, fp32 master weights")
    a("--fp16", action="store_true", help="fp16 compute with loss scaling, fp32 master weights")
    a("--loss-scale", type=float, default=None, help="constant fp16 loss scale (None: dynamic)")
    a("--initial-loss-scale", type=float, default=2 ** 32, help="first dynamic loss scale")
    a("--min-loss-scale", type=float, default=1.0, help="smallest dynamic loss scale")
    a("--loss-scale-window", type=float, default=1000, help="good steps before the dynamic scale grows")
    a("--hysteresis", type=int, default=2, help="overflows tolerated before the dynamic scale shrinks")
    a("--accumulate-allreduce-grads-in-fp32", action="store_true", help="reduce gradients in fp32")
    a("--grad-reduce-in-bf16", action="store_true", help="with --bf16, reduce gradients in bf16 instead of fp32")


def _fp8(p) -> None:
    g = p.add_argument_group("fp8 (Transformer-Engine's flags in Megatron-LM)")
    a = g.add_argument
    a("--fp8-format", dest="fp8", choices=["e4m3", "hybrid"], default=None,
      help="fp8 GEMMs in the transformer layers' linears (hybrid: e5m2 gradients)")
    a("--fp8-recipe", choices=["tensorwise", "delayed", "rowwise"], default="delayed",
      help="scaling: per tensor now (tensorwise), from amax histories (delayed), per row (rowwise)")
    a("--fp8-margin", type=int, default=0, help="scale margin (powers of two)")
    a("--fp8-amax-history-len", type=int, default=1, help="amax history of delayed scaling")
    a("--fp8-amax-compute-algo", choices=["most_recent", "max"], default="most_recent",
      help="how delayed scaling reads its history")
    a("--no-fp8-wgrad", dest="fp8_wgrad", action="store_false", help="weight-gradient GEMM in high precision")
    a("--first-last-layers-bf16", action="store_true", help="keep the first/last layers out of fp8")
    a("--num-layers-at-start-in-bf16", type=int, default=1, help="first layers kept in high precision")
    a("--num-layers-at-end-in-bf16", type=int, default=1, help="last layers kept in high precision")
    a("--fp8-param-gather", action="store_true", help="all-gather the fp8 linears' weights in fp8 (FSDP2)")


def _distributed(p) -> None:
    g = p.add_argument_group("distributed")
    a = g.add_argument
    a("--tensor-model-parallel-size", type=int, default=1, help="tensor-parallel ranks")
    a("--sequence-parallel", action="store_true", help="split norms and dropouts over TP ranks by sequence")
    a("--context-parallel-size", type=int, default=1,
      help="context-parallel ranks: each sequence split over them (world size = TP x CP x DP)")
    a("--cp-comm-type", nargs="+", default=["p2p"],
      help="context-parallel attention: p2p (a ring), all_gather, a2a (Ulysses) or a2a+p2p (hierarchical); "
           "one, or one per layer")
    a("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
      help="the a2a and p2p group sizes of --cp-comm-type a2a+p2p (their product is the CP size)")
    a("--use-torch-fsdp2", action="store_true", help="shard the model with TorchFullyShardedDataParallel")
    a("--torch-fsdp2-no-reshard-after-forward", action="store_true",
      help="keep gathered weights from forward to backward (ZeRO-2)")
    # Not a Megatron flag: Megatron's FSDP2 path always reduce-scatters each microbatch.
    a("--torch-fsdp2-accumulate-unsharded-grads", action="store_true",
      help="accumulate unsharded gradients over microbatches, one reduce-scatter per step (not Megatron's)")
    # Not a Megatron flag: the run's log says which copy ops serve.
    a("--torch-fsdp2-copy-kernels", action=argparse.BooleanOptionalAction, default=None,
      help="megatron_fsdp's kernels behind FSDP2's copy ops (None: on with --use-torch-fsdp2; not Megatron's)")
    # Not a Megatron flag: torchtitan's per-block compile.
    a("--torch-compile", action="store_true",
      help="compile each TransformerLayer with torch.compile before sharding (not Megatron's)")
    a("--num-distributed-optimizer-instances", type=int, default=1,
      help="HSDP: replicas of the sharded model (each shards over DP / instances ranks)")
    a("--use-distributed-optimizer", action="store_true", help="shard optimizer state (always so under FSDP)")
    a("--optimizer-cpu-offload", action="store_true",
      help="sharded params, grads and optimizer state in CPU memory, the optimizer step on the CPU (FSDP2's offload)")
    a("--overlap-grad-reduce", action="store_true", help="overlap gradient reduction (always so under FSDP)")
    a("--overlap-param-gather", action="store_true", help="overlap parameter all-gathers (always so under FSDP)")
    a("--distributed-backend", choices=["nccl", "gloo"], default=None, help="None: nccl with GPUs, else gloo")
    a("--distributed-timeout-minutes", type=float, default=10, help="collective timeout")
    # Not Megatron flags: torchtitan's comm.trace_buf_size and save_traces_folder (training/flight_recorder.py).
    a("--flight-recorder-dir", default=None,
      help="where each rank's Flight Recorder trace goes on a collective timeout, as <dir>/rank_<rank> (None: "
           "$TORCH_FR_DUMP_TEMP_FILE's prefix if set, else comm_traces/; not Megatron's)")
    a("--flight-recorder-buffer-size", type=int, default=None,
      help="collectives the Flight Recorder keeps per process (TORCH_FR_BUFFER_SIZE; None: torch's default; "
           "0: off; not Megatron's)")


def _moe(p) -> None:
    g = p.add_argument_group("moe", "mixture of experts (Megatron-LM's flags; transformer/moe/)")
    a = g.add_argument
    a("--num-experts", type=int, default=None, help="experts per MoE layer (None: dense MLPs)")
    a("--expert-model-parallel-size", type=int, default=1, help="expert-parallel ranks (experts split over them)")
    a("--expert-tensor-parallel-size", type=int, default=None,
      help="tensor-parallel ranks of each expert (None: --tensor-model-parallel-size)")
    a("--moe-layer-freq", type=moe_layer_freq, default=1,
      help="every N-th layer is MoE, or a pattern of 0/1 per layer such as '([1]*3+[0])*2'")
    a("--moe-ffn-hidden-size", type=int, default=None, help="each expert's FFN size (None: --ffn-hidden-size)")
    a("--moe-router-topk", type=int, default=2, help="experts per token")
    a("--moe-router-load-balancing-type", default="aux_loss",
      help="aux_loss (per micro-batch), seq_aux_loss (per sequence) or none")
    a("--moe-aux-loss-coeff", type=float, default=0.0, help="the load-balancing loss's coefficient")
    a("--moe-z-loss-coeff", type=float, default=None, help="the router z-loss's coefficient")
    a("--moe-router-score-function", default="softmax", help="softmax or sigmoid")
    a("--moe-router-pre-softmax", action="store_true", help="softmax over every expert before the top-k")
    a("--moe-router-topk-scaling-factor", type=float, default=None, help="scale of the top-k scores")
    a("--moe-router-dtype", default=None, help="the router's dtype: fp32 or fp64 (None: the model's)")
    a("--moe-router-enable-expert-bias", action="store_true",
      help="auxiliary-loss-free balancing: a per-expert bias on the selection, updated each step")
    a("--moe-router-bias-update-rate", type=float, default=1e-3, help="the expert bias's update rate")
    a("--moe-router-num-groups", type=int, default=None, help="group-limited routing's groups (not supported)")
    a("--moe-router-group-topk", type=int, default=None, help="group-limited routing's groups per token (not supported)")
    a("--moe-input-jitter-eps", type=float, default=None, help="input jitter (not supported)")
    a("--moe-token-dispatcher-type", default="allgather", help="allgather or alltoall")
    a("--moe-grouped-gemm", action="store_true", help="one grouped GEMM for the local experts where available")
    a("--moe-expert-capacity-factor", type=float, default=None, help="tokens per expert cap (None: dropless)")
    a("--moe-token-drop-policy", default="probs", help="over capacity, drop by: probs or position")
    a("--moe-pad-expert-input-to-capacity", action="store_true", help="pad each expert's tokens to its capacity")
    a("--moe-shared-expert-intermediate-size", type=int, default=None, help="the shared expert's FFN size")
    a("--moe-shared-expert-gate", action="store_true", help="a sigmoid gate on the shared expert's output (Qwen2)")
    a("--moe-shared-expert-overlap", action="store_true", help="overlap the shared expert (not supported)")
    a("--moe-permute-fusion", action="store_true", help="Transformer Engine's fused permutation (not supported)")
    a("--moe-per-layer-logging", action="store_true", help="the aux losses of each layer (not supported)")


def moe_layer_freq(text: str):
    """--moe-layer-freq: an int, or a list of 0/1 written as Megatron-LM does ('[1,0,1]',
    '([1]*3+[0]*1)*2'): list displays, ints, + and * only (evaluated without eval)."""
    import ast

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(text)
    try:
        result = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not an int or a list pattern such as '([1]*3+[0])*2'")
    return result


def _validation(p) -> None:
    g = p.add_argument_group("validation")
    g.add_argument("--eval-iters", type=int, default=100, help="iterations per evaluation")
    g.add_argument("--eval-interval", type=int, default=None, help="iterations between evaluations (None: none)")


def _data(p) -> None:
    g = p.add_argument_group("data and dataloader")
    a = g.add_argument
    a("--mock-data", action="store_true", help="random tokens instead of a dataset")
    a("--data-path", nargs="*", default=None, help="dataset prefixes, optionally weighted: [W1] P1 [W2] P2 ...")
    a("--split", default=None, help="train,valid,test shares of --data-path (None: 969,30,1)")
    a("--train-data-path", nargs="*", default=None, help="training dataset prefixes")
    a("--valid-data-path", nargs="*", default=None, help="validation dataset prefixes")
    a("--test-data-path", nargs="*", default=None, help="test dataset prefixes")
    a("--per-split-data-args-path", default=None, help="JSON file with the three per-split path lists")
    a("--data-cache-path", default=None, help="directory for the index caches")
    a("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false", help="read .bin files without mmap")
    a("--num-workers", type=int, default=2, help="data loader worker processes")
    a("--dataloader-type", choices=["single", "cyclic"], default="single", help="sampler")
    a("--reset-position-ids", action="store_true", help="restart position ids after each end-of-document")
    a("--reset-attention-mask", action="store_true", help="no attention across end-of-document")
    a("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    a("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
      action="store_false", help="the model builds the causal mask")
    a("--num-dataset-builder-threads", type=int, default=1, help="threads building the datasets")
    a("--mid-level-dataset-surplus", type=float, default=0.005, help="extra samples requested of blended parts")


def _tokenizer(p) -> None:
    g = p.add_argument_group("tokenizer")
    a = g.add_argument
    a("--tokenizer-type", default="NullTokenizer", choices=["NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer"],
      help="tokenizer")
    a("--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary")
    a("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    a("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")
    a("--tokenizer-model", default=None, help="HuggingFaceTokenizer's folder or tokenizer.json")
    a("--vocab-extra-ids", type=int, default=0, help="T5's extra sentinel tokens (0 only: GPT pretraining)")
    a("--tokenizer-hf-no-include-special-tokens", action="store_true", help="no BOS/EOS from the post-processor")
    a("--make-vocab-size-divisible-by", type=int, default=128, help="pad the vocabulary to a multiple of this x TP")


def _logging(p) -> None:
    g = p.add_argument_group("logging")
    a = g.add_argument
    a("--log-interval", type=int, default=100, help="iterations between log lines")
    a("--log-throughput", action="store_true", help="TFLOP/s and tokens/s in the log line")
    a("--log-params-norm", action="store_true", help="parameter norm in the log line")
    a("--log-num-zeros-in-grad", action="store_true", help="zeros in the gradient in the log line")
    a("--tensorboard-dir", default=None, help="TensorBoard event directory")
    a("--tensorboard-log-interval", type=int, default=1, help="iterations between TensorBoard writes")
    a("--tensorboard-queue-size", type=int, default=1000, help="TensorBoard writer queue")
    a("--log-timers-to-tensorboard", action="store_true", help="iteration time and throughput scalars")
    a("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard", action="store_false",
      help="no loss-scale scalar")
    a("--log-validation-ppl-to-tensorboard", action="store_true", help="validation perplexity scalar")
    a("--log-memory-to-tensorboard", action="store_true", help="memory scalars")
    a("--log-world-size-to-tensorboard", action="store_true", help="world-size scalar")
    a("--wandb-project", default=None, help="Weights & Biases project")
    a("--wandb-exp-name", default=None, help="Weights & Biases run name")
    a("--wandb-save-dir", default=None, help="Weights & Biases directory")


def _profiling(p) -> None:
    # Megatron-LM's flags (training/profiling.py); iterations are numbered as in the log line.
    g = p.add_argument_group("profiling")
    a = g.add_argument
    a("--profile", action="store_true",
      help="profile iterations --profile-step-start..--profile-step-end - 1: for Nsight Systems (cudaProfilerStart/"
           "Stop and NVTX ranges; run under `nsys profile --capture-range=cudaProfilerApi`), or with "
           "--use-pytorch-profiler the torch profiler")
    a("--use-pytorch-profiler", action="store_true",
      help="with --profile: the torch profiler, one trace per profiled rank (TensorBoard's format)")
    a("--profile-step-start", type=int, default=10, help="first profiled iteration")
    a("--profile-step-end", type=int, default=12, help="the iteration after the last profiled one")
    a("--profile-ranks", nargs="+", type=int, default=[0], help="global ranks to profile")
    a("--pytorch-profiler-collect-shapes", action="store_true", help="record the operators' input shapes")
    a("--pytorch-profiler-collect-callstack", action="store_true", help="record the Python call stacks")
    # Not a Megatron flag: Megatron-LM writes the traces into --tensorboard-dir.
    a("--profile-dir", default=None,
      help="where the torch profiler's traces go (None: --tensorboard-dir; not Megatron's)")
    a("--record-memory-history", action="store_true",
      help="record the CUDA caching allocator's history from start-up; a snapshot at the end of the profiled "
           "iterations (last rank) and on an out-of-memory error (that rank)")
    a("--memory-snapshot-path", default="snapshot.pickle", help="where the memory snapshot goes")
