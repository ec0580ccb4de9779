"""Column-, row- and vocab-parallel layers with Megatron-Core's constructors.

Weights are DTensors on the tensor-parallel mesh (column: Shard(0), row:
Shard(1), vocab: Shard(0)), so FSDP2 composes them into 2D (DP, TP)
parameters and distributed checkpoints reshard across TP sizes. The forward
pass is Megatron's: explicit communication (mappings.py) around local matmuls
on the shards. The local matmul is one method, `_matmul(x, weight, bias)`:
megatron_fsdp.fp8's converter turns a linear into its fp8 subclass, which
overrides only that (these layers know nothing of fp8).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import parallel_state
from ..utils import check_positive_int, reject_unsupported
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .reset import ResetsDeclaredParameters
from .utils import (VocabUtility, constant_init, divide, init_full_tensor, local_tensor, make_tp_parameter,
                    record_init)


def _check_tp_group(layer: str, tp_group) -> None:
    # Weights live on parallel_state's TP mesh; another group would silently disagree with it.
    if tp_group is not None and tp_group is not parallel_state.get_tensor_model_parallel_group():
        raise ValueError(
            f"{layer}: tp_group must be None or parallel_state's tensor-model-parallel group"
        )


def _check_input(layer: str, x: torch.Tensor, expected: int, what: str) -> None:
    if x.size(-1) != expected:
        raise ValueError(
            f"{layer}: input's last dimension is {x.size(-1)}, expected {expected} ({what})"
        )


class _LocalMatmul:
    """The one local GEMM of a parallel linear: y = x W^T (+ b), on this rank's shards."""

    def _matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def local_weight_shape(self) -> tuple[int, int]:
        """[out, in] of this rank's weight shard."""
        raise NotImplementedError


def _sp_shared(param: Optional[torch.Tensor], sequence_parallel: bool) -> Optional[torch.Tensor]:
    """A replicated parameter applied to a sequence-parallel shard of the tokens:
    each TP rank sees a part of its gradient, so the gradients are summed."""
    if param is None:
        return None
    local = local_tensor(param)
    return copy_to_tensor_model_parallel_region(local) if sequence_parallel else local


class ColumnParallelLinear(ResetsDeclaredParameters, _LocalMatmul, nn.Module):
    """Y = XA + b with A split along its output dimension (Shard(0) of the [out, in] weight)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: Optional[list] = None,
        grad_output_buffer: Optional[list] = None,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        disable_grad_reduce: bool = False,
        tp_group=None,
    ):
        super().__init__()
        name = type(self).__name__
        reject_unsupported(name, {
            "keep_master_weight_for_test": (keep_master_weight_for_test, False),
            "embedding_activation_buffer": (embedding_activation_buffer, None),
            "grad_output_buffer": (grad_output_buffer, None), "is_expert": (is_expert, False)})
        _check_tp_group(name, tp_group)
        self.config = config
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.disable_grad_reduce = disable_grad_reduce
        self.sequence_parallel = config.sequence_parallel
        self.tp_comm_buffer_name = tp_comm_buffer_name  # names a TE comm buffer; no buffer here
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        # Megatron's stride (partition_stride): the rank's rows are `stride` slices of the full
        # weight (a gated MLP's fc1: its gate and up rows); see tensor_parallel.partition_stride.
        self.stride = check_positive_int("stride", stride, name)
        if stride > 1 and output_size % (stride * tp_size) != 0:
            raise ValueError(f"{name}: output_size {output_size} is not divisible by stride {stride} x the "
                             f"tensor-parallel size {tp_size}")
        self.output_size_per_partition = divide(output_size, tp_size)
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = make_tp_parameter(
                init_full_tensor((output_size, input_size), init_method, config), 0, config, stride)
            record_init(self, "weight", init_method, config)
        if bias:
            full_bias = init_full_tensor((output_size,), constant_init(0.0), config)
            self.bias = make_tp_parameter(full_bias, 0, config, stride)
            record_init(self, "bias", constant_init(0.0), config)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        """Returns (output, bias): bias is None unless skip_bias_add."""
        if weight is None:
            weight = self.weight
            if weight is None:
                raise ValueError(
                    "ColumnParallelLinear was built with skip_weight_param_allocation=True: "
                    "pass `weight` to forward()"
                )
        weight = local_tensor(weight)
        expected_shape = (self.output_size_per_partition, self.input_size)
        if tuple(weight.shape) != expected_shape:
            raise ValueError(
                f"ColumnParallelLinear: weight's local shape is {tuple(weight.shape)}, "
                f"expected {expected_shape}"
            )
        _check_input("ColumnParallelLinear", input_, self.input_size, "input_size")
        if self.sequence_parallel:
            input_parallel = gather_from_sequence_parallel_region(input_)
        elif self.disable_grad_reduce:
            input_parallel = input_
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_)
        bias = local_tensor(self.bias) if self.bias is not None else None
        output = self._matmul(input_parallel, weight, None if self.skip_bias_add else bias)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            output = gather_from_tensor_model_parallel_region(output)
        return output, (bias if self.skip_bias_add else None)

    def local_weight_shape(self) -> tuple[int, int]:
        return self.output_size_per_partition, self.input_size

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelLinear(ResetsDeclaredParameters, _LocalMatmul, nn.Module):
    """Y = XA + b with A split along its input dimension (Shard(1) of the [out, in] weight)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: Callable,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        tp_group=None,
    ):
        super().__init__()
        name = type(self).__name__
        reject_unsupported(name, {
            "stride": (stride, 1), "keep_master_weight_for_test": (keep_master_weight_for_test, False),
            "is_expert": (is_expert, False)})
        _check_tp_group(name, tp_group)
        if config.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        self.config = config
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = config.sequence_parallel
        self.tp_comm_buffer_name = tp_comm_buffer_name
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.input_size_per_partition = divide(input_size, tp_size)
        self.weight = make_tp_parameter(
            init_full_tensor((output_size, input_size), init_method, config), 1, config)
        record_init(self, "weight", init_method, config)
        if bias:
            self.bias = make_tp_parameter(init_full_tensor((output_size,), constant_init(0.0), config), None,
                                          config)
            record_init(self, "bias", constant_init(0.0), config)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        """Returns (output, bias): bias is None unless skip_bias_add."""
        if self.input_is_parallel:
            _check_input("RowParallelLinear", input_, self.input_size_per_partition,
                         "input_size / tensor-parallel size")
            input_parallel = input_
        else:
            _check_input("RowParallelLinear", input_, self.input_size, "input_size")
            input_parallel = scatter_to_tensor_model_parallel_region(input_)
        output_parallel = self._matmul(input_parallel, local_tensor(self.weight), None)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel)
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel)
        bias = _sp_shared(self.bias, self.sequence_parallel)
        if self.skip_bias_add:
            return output, bias
        if bias is not None:
            output = output + bias
        return output, None

    def local_weight_shape(self) -> tuple[int, int]:
        return self.output_size, self.input_size_per_partition

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(ResetsDeclaredParameters, nn.Module):
    """Embedding table split along the vocabulary (Shard(0)); each rank looks up
    the ids in its range, and the partial results are summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Callable,
                 reduce_scatter_embeddings: bool = False, config, tp_group=None):
        super().__init__()
        _check_tp_group(type(self).__name__, tp_group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        if num_embeddings % tp_size != 0:
            raise ValueError(
                f"VocabParallelEmbedding: vocabulary size {num_embeddings} is not divisible by the "
                f"tensor-parallel size {tp_size}; pad it (Megatron's --make-vocab-size-divisible-by)"
            )
        self.num_embeddings_per_partition = num_embeddings // tp_size
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, parallel_state.get_tensor_model_parallel_rank(), tp_size)
        self.weight = make_tp_parameter(
            init_full_tensor((num_embeddings, embedding_dim), init_method, config), 0, config)
        record_init(self, "weight", init_method, config)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """[b, s] ids -> [b, s, h], or [s/tp, b, h] with reduce_scatter_embeddings."""
        weight = local_tensor(self.weight)
        if self.num_embeddings_per_partition == self.num_embeddings:
            output = F.embedding(input_, weight)
        else:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
            output = F.embedding(local_ids, weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(output.transpose(0, 1).contiguous())
        return reduce_from_tensor_model_parallel_region(output)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"
