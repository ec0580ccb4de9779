"""The auxiliary losses of the MoE layers, for logging (Megatron-Core 0.19's moe_logging).

Each router records its losses per layer as it runs (`record`, from the forward of training
micro-batches); the training loop reduces them once per step (`reduce_moe_metrics`, or
Megatron's `track_moe_metrics`), which also clears them. What a reported value means:

- "load_balancing_loss" (moe_router_load_balancing_type="aux_loss"; "seq_load_balancing_loss"
  for "seq_aux_loss"): the loss without its coefficient, of each micro-batch's whole
  sequences: each tensor/context-parallel rank records its part, and the parts are summed over
  that group;
- "z_loss": mean over tokens of logsumexp(logits)^2, without the coefficient; the ranks' values
  are averaged over the tensor x data x context parallel group;
- then either is averaged over the data-parallel ranks, summed over the micro-batches of the
  step times `loss_scale` (1 / number of micro-batches: their mean), and summed over the layers
  divided by the number of MoE layers (their mean).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Optional, Union

import torch
import torch.distributed as dist

from ... import parallel_state
from .moe_config import is_moe_layer


@dataclasses.dataclass
class MetricEntry:
    """One metric's per-layer values and how to reduce them over ranks."""

    values: torch.Tensor
    reduce_group: Optional[dist.ProcessGroup] = None
    avg_group: Optional[dist.ProcessGroup] = None
    needs_dp_avg: bool = True


class MoEMetricsTracker:
    """Per-layer MoE metrics: `record` during forward, `reduce` (or `report`) once per step."""

    def __init__(self):
        self._metrics: dict[str, MetricEntry] = {}

    @property
    def metrics(self) -> dict[str, MetricEntry]:
        return self._metrics

    def record(self, name: str, value: torch.Tensor, layer_number: Optional[int], num_layers: int,
               reduce_group: Optional[dist.ProcessGroup] = None, avg_group: Optional[dist.ProcessGroup] = None,
               needs_dp_avg: bool = True) -> None:
        """Add `value` to layer `layer_number`'s (from 1) entry of `name` (nothing without a layer number)."""
        if layer_number is None:
            return
        if not 1 <= layer_number <= num_layers:
            raise ValueError(f"MoEMetricsTracker.record: layer_number must be in [1, {num_layers}], "
                             f"got {layer_number}")
        if name not in self._metrics:
            self._metrics[name] = MetricEntry(values=torch.zeros(num_layers, device=value.device))
        entry = self._metrics[name]
        entry.values[layer_number - 1] += value.detach()
        entry.reduce_group, entry.avg_group, entry.needs_dp_avg = reduce_group, avg_group, needs_dp_avg

    def clear(self) -> None:
        """Zero every value (the entries stay)."""
        for entry in self._metrics.values():
            entry.values.zero_()

    def ensure_initialized(self, name: str, num_layers: int, device=None) -> None:
        """An entry of zeros for `name` if there is none (a rank that recorded nothing still joins
        the reductions)."""
        if name not in self._metrics:
            device = device if device is not None else parallel_state.get_device_or_cpu()
            self._metrics[name] = MetricEntry(values=torch.zeros(num_layers, device=device))

    def sync(self, names: list[str]) -> None:
        """Reduce the named metrics over ranks, in place: sum over the reduce group, average over
        the avg group, then average over the data-parallel ranks. Every rank must call it."""
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=False)
        for name in names:
            entry = self._metrics.get(name)
            if entry is None:
                continue
            if entry.reduce_group is not None:
                dist.all_reduce(entry.values, group=entry.reduce_group)
            if entry.avg_group is not None:
                _all_reduce_mean(entry.values, entry.avg_group)
            if entry.needs_dp_avg:
                _all_reduce_mean(entry.values, dp_group)

    def reduce(self, loss_scale: float, num_layers: int, moe_layer_freq: Union[int, list] = 1,
               track_names: Optional[list[str]] = None, force_initialize: bool = False) -> dict[str, torch.Tensor]:
        """{name: value} as the module docstring says (0-dim device tensors: reading them is the
        caller's synchronization), then the values are cleared. Every rank must call it.
        `force_initialize` creates missing `track_names` (zeros) first."""
        names = list(self._metrics) if track_names is None else list(track_names)
        if force_initialize:
            for name in names:
                self.ensure_initialized(name, num_layers, parallel_state.get_device())
        self.sync(names)
        layers = num_moe_layers(num_layers, moe_layer_freq)
        result = {name: self._metrics[name].values.float().sum() * (loss_scale / layers)
                  for name in names if name in self._metrics}
        self.clear()
        return result

    def report(self, loss_scale: float, iteration: int, writer=None, wandb_writer=None,
               per_layer_logging: bool = False, force_initialize: bool = False,
               track_names: Optional[Union[str, list[str]]] = None, num_layers: Optional[int] = None,
               moe_layer_freq: Optional[Union[int, list]] = None, mtp_num_layers: Optional[int] = None,
               total_loss_dict: Optional[dict] = None, percentiles: Optional[dict] = None,
               pg_collection=None) -> str:
        """Megatron's report: reduce (see `reduce`), write each value to the writers, add the
        losses to `total_loss_dict`, clear; returns " name: value |" for the values not added there."""
        if per_layer_logging or mtp_num_layers or percentiles or pg_collection is not None:
            raise NotImplementedError("MoEMetricsTracker.report: per_layer_logging, mtp_num_layers, percentiles "
                                      "and pg_collection are not supported")
        if num_layers is None:
            raise ValueError("MoEMetricsTracker.report: num_layers is required (the model's layer count)")
        names = [track_names] if isinstance(track_names, str) else track_names
        scalars = {name: float(value) for name, value in self.reduce(
            loss_scale, num_layers, 1 if moe_layer_freq is None else moe_layer_freq, names, force_initialize).items()}
        for name, value in scalars.items():
            if writer is not None:
                writer.add_scalar(name, value, iteration)
            if wandb_writer is not None:
                wandb_writer.log({name: value}, iteration)
        shown = dict(scalars)
        if total_loss_dict is not None:
            for name in [n for n in scalars if n.lower().endswith("loss")]:
                total_loss_dict[name] = total_loss_dict.get(name, 0.0) + shown.pop(name)
        return "".join(f" {name}: {value:.2f} |" for name, value in shown.items())


def _all_reduce_mean(values: torch.Tensor, group: dist.ProcessGroup) -> None:
    # gloo has no ReduceOp.AVG: a sum, then the division.
    dist.all_reduce(values, group=group)
    values.div_(dist.get_world_size(group))


def num_moe_layers(num_layers: int, moe_layer_freq: Union[int, list] = 1) -> int:
    """How many of `num_layers` layers have experts (Megatron's moe_layer_freq rule)."""
    pattern = types.SimpleNamespace(num_moe_experts=1, moe_layer_freq=moe_layer_freq)
    return sum(is_moe_layer(pattern, n) for n in range(1, num_layers + 1))


_MOE_METRICS_TRACKER: Optional[MoEMetricsTracker] = None


def get_moe_metrics_tracker() -> MoEMetricsTracker:
    """The process's tracker (made on first use)."""
    global _MOE_METRICS_TRACKER
    if _MOE_METRICS_TRACKER is None:
        _MOE_METRICS_TRACKER = MoEMetricsTracker()
    return _MOE_METRICS_TRACKER


def set_moe_metrics_tracker(tracker: MoEMetricsTracker) -> None:
    global _MOE_METRICS_TRACKER
    _MOE_METRICS_TRACKER = tracker


def destroy_moe_metrics_tracker() -> None:
    global _MOE_METRICS_TRACKER
    _MOE_METRICS_TRACKER = None


# Its entries hold the groups of the parallel state: stale once that is destroyed.
parallel_state.on_destroy_model_parallel(destroy_moe_metrics_tracker)


def reduce_moe_metrics(loss_scale: float, num_layers: int, moe_layer_freq: Union[int, list] = 1,
                       track_names: Optional[list[str]] = None) -> dict[str, torch.Tensor]:
    """What the training loop calls after each step (every rank): {"load_balancing_loss": ...,
    "z_loss": ...} for the losses the routers recorded (see the module docstring), as Megatron's
    track_moe_metrics computes them; pass loss_scale = 1 / number of micro-batches. Clears them."""
    return get_moe_metrics_tracker().reduce(loss_scale, num_layers, moe_layer_freq, track_names)


# Megatron-Core's function names (moe_utils), over the tracker.


def save_to_aux_losses_tracker(name: str, loss: torch.Tensor, layer_number: Optional[int], num_layers: int,
                               reduce_group: Optional[dist.ProcessGroup] = None,
                               avg_group: Optional[dist.ProcessGroup] = None,
                               reduce_group_has_dp: bool = False) -> None:
    get_moe_metrics_tracker().record(name, loss, layer_number, num_layers, reduce_group=reduce_group,
                                     avg_group=avg_group, needs_dp_avg=not reduce_group_has_dp)


def clear_aux_losses_tracker() -> None:
    get_moe_metrics_tracker().clear()


def reduce_aux_losses_tracker_across_ranks(track_names: Optional[list[str]] = None, pg_collection=None) -> None:
    if pg_collection is not None:
        raise NotImplementedError("reduce_aux_losses_tracker_across_ranks: pg_collection is not supported "
                                  "(the groups come from parallel_state)")
    tracker = get_moe_metrics_tracker()
    tracker.sync(list(tracker.metrics) if track_names is None else list(track_names))


def get_moe_layer_wise_logging_tracker() -> dict:
    """{name: {"values", "reduce_group", "avg_group", "needs_dp_avg"}}: Megatron's legacy view."""
    return {name: {"values": e.values, "reduce_group": e.reduce_group, "avg_group": e.avg_group,
                   "needs_dp_avg": e.needs_dp_avg} for name, e in get_moe_metrics_tracker().metrics.items()}


def track_moe_metrics(loss_scale: float, iteration: int, writer=None, wandb_writer=None,
                      total_loss_dict: Optional[dict] = None, per_layer_logging: bool = False,
                      force_initialize: bool = False, track_names: Optional[list[str]] = None,
                      num_layers: Optional[int] = None, moe_layer_freq=None, mtp_num_layers: Optional[int] = None,
                      pg_collection=None) -> str:
    """Megatron's step-end call: see MoEMetricsTracker.report."""
    return get_moe_metrics_tracker().report(
        loss_scale, iteration, writer=writer, wandb_writer=wandb_writer, per_layer_logging=per_layer_logging,
        force_initialize=force_initialize, track_names=track_names, num_layers=num_layers,
        moe_layer_freq=moe_layer_freq, mtp_num_layers=mtp_num_layers, total_loss_dict=total_loss_dict,
        pg_collection=pg_collection)
