"""A plain reference of a mixture-of-experts layer for the MoE tests: every token through its
top-k experts by Python loops over tokens and experts, with the full weights, and the
auxiliary losses by their formulas. Written apart from megatron_fsdp.transformer.moe (it shares
no code with it): the tests compare the library with this.

Data layout: x is [R, S, B, H]: R replicas (data-parallel ranks' micro-batches) of B
sequences of S tokens. Each replica is cut along S into `chunks` parts (its tensor/context
parallel ranks' tokens), and each part is routed on its own (a capacity is per part), as
each rank routes its own tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch


@dataclasses.dataclass
class Weights:
    router: torch.Tensor  # [E, H]
    fc1: torch.Tensor  # [E, G, F, H]: G = 2 (gate, up) when gated
    fc2: torch.Tensor  # [E, H, F]
    shared_fc1: Optional[torch.Tensor] = None  # [G * Fs, H]: gate rows, then up rows
    shared_fc2: Optional[torch.Tensor] = None  # [H, Fs]
    shared_gate: Optional[torch.Tensor] = None  # [1, H]
    expert_bias: Optional[torch.Tensor] = None  # [E] (not trained)

    def named(self) -> dict[str, torch.Tensor]:
        """The trained weights by the MoELayer parameter name that holds them."""
        names = {"router": "router.weight", "fc1": "experts.linear_fc1.weight", "fc2": "experts.linear_fc2.weight",
                 "shared_fc1": "shared_experts.linear_fc1.weight", "shared_fc2": "shared_experts.linear_fc2.weight",
                 "shared_gate": "shared_experts.gate_weight"}
        return {names[k]: getattr(self, k) for k in names if getattr(self, k) is not None}


def draw_weights(config, seed: int = 0, scale: float = 0.3) -> Weights:
    """Weights of a useful size (the library's init is small): the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    E, H, Fe = config.num_moe_experts, config.hidden_size, config.moe_ffn_hidden_size
    G = 2 if config.gated_linear_unit else 1

    def randn(*shape):
        return torch.randn(*shape, generator=g) * scale

    w = Weights(router=randn(E, H), fc1=randn(E, G, Fe, H), fc2=randn(E, H, Fe))
    if config.moe_shared_expert_intermediate_size is not None:
        Fs = config.moe_shared_expert_intermediate_size
        w.shared_fc1, w.shared_fc2 = randn(G * Fs, H), randn(H, Fs)
        if config.moe_shared_expert_gate:
            w.shared_gate = randn(1, H)
    if config.moe_router_enable_expert_bias:
        w.expert_bias = torch.randn(E, generator=g) * 0.3
    return w


def _top(values: list[float], k: int) -> list[int]:
    return sorted(range(len(values)), key=lambda e: -values[e])[:k]


def _route_token(config, logits: torch.Tensor, bias: Optional[torch.Tensor]) -> dict[int, torch.Tensor]:
    """{expert: weight} of one token."""
    k = config.moe_router_topk
    if config.moe_router_score_function == "softmax":
        if config.moe_router_pre_softmax:
            scores = torch.softmax(logits, dim=0)
            chosen = _top(scores.tolist(), k)
            weights = [scores[e] for e in chosen]
        else:
            chosen = _top(logits.tolist(), k)
            weights = list(torch.softmax(torch.stack([logits[e] for e in chosen]), dim=0))
    else:
        scores = torch.sigmoid(logits)
        keys = [scores[e].item() + (0.0 if bias is None else bias[e].item()) for e in range(len(scores))]
        chosen = _top(keys, k)
        weights = [scores[e] for e in chosen]
        if k > 1:
            total = sum(weights) + 1e-20
            weights = [w / total for w in weights]
    factor = config.moe_router_topk_scaling_factor
    return {e: (w * factor if factor else w) for e, w in zip(chosen, weights)}


def _drop(config, routes: list[dict]) -> list[dict]:
    """Each expert keeps at most its capacity of one part's tokens: by weight, or the earliest."""
    factor = config.moe_expert_capacity_factor
    if factor is None:
        return routes
    E, k = config.num_moe_experts, config.moe_router_topk
    capacity = math.ceil(len(routes) * k / E * factor)
    kept = [dict() for _ in routes]
    for e in range(E):
        tokens = [t for t, r in enumerate(routes) if e in r]
        if config.moe_token_drop_policy == "probs":
            tokens = sorted(tokens, key=lambda t: -routes[t][e].item())
        for t in tokens[:capacity]:
            kept[t][e] = routes[t][e]
    return kept


def _act(config, h: torch.Tensor) -> torch.Tensor:
    return config.activation_func(h)


def _expert(config, w: Weights, e: int, x: torch.Tensor) -> torch.Tensor:
    if config.gated_linear_unit:
        hidden = _act(config, w.fc1[e, 0] @ x) * (w.fc1[e, 1] @ x)
    else:
        hidden = _act(config, w.fc1[e, 0] @ x)
    return w.fc2[e] @ hidden


def _shared(config, w: Weights, x: torch.Tensor) -> torch.Tensor:
    Fs = w.shared_fc2.shape[1]
    if config.gated_linear_unit:
        hidden = _act(config, w.shared_fc1[:Fs] @ x) * (w.shared_fc1[Fs:] @ x)
    else:
        hidden = _act(config, w.shared_fc1 @ x)
    out = w.shared_fc2 @ hidden
    if w.shared_gate is not None:
        out = out * torch.sigmoid(w.shared_gate[0] @ x)
    return out


def _aux_scores(config, logits: torch.Tensor) -> torch.Tensor:
    if config.moe_router_score_function == "softmax":
        return torch.softmax(logits, dim=0)
    s = torch.sigmoid(logits)
    return s / (s.sum() + 1e-20)


def _switch_loss(config, scores: list[torch.Tensor], total_tokens: float, coeff: float) -> torch.Tensor:
    """E * coeff / (k T^2) * sum_e (sum_t score[t, e]) * (tokens whose top-k has e)."""
    E, k = config.num_moe_experts, config.moe_router_topk
    loss = 0.0
    for e in range(E):
        probability = sum(s[e] for s in scores)
        count = sum(1 for s in scores if e in _top(s.tolist(), k))
        loss = loss + probability * count
    return loss * (E * coeff / (k * total_tokens * total_tokens))


@dataclasses.dataclass
class Result:
    output: torch.Tensor  # [R, S, B, H]
    aux_loss: torch.Tensor  # everything the auxiliary losses add to the objective
    logged: dict  # what the tracker reports (mean over replicas / parts)
    tokens_per_expert: list  # routed (kept, non-padding) tokens per expert, all replicas


def _replica(config, w: Weights, x: torch.Tensor, chunks: int, padding: Optional[torch.Tensor]):
    """One replica [S, B, H]: outputs, aux-loss terms, logged values, counts."""
    S, B, H = x.shape
    rows = {}
    counts = [0] * config.num_moe_experts
    all_logits, z_terms, z_logged = {}, [], []
    part = S // chunks
    for c in range(chunks):
        tokens = [(s, b) for s in range(c * part, (c + 1) * part) for b in range(B)]
        logits = {t: w.router @ x[t] for t in tokens}
        all_logits.update(logits)
        routes = _drop(config, [_route_token(config, logits[t], w.expert_bias) for t in tokens])
        for (s, b), route in zip(tokens, routes):
            y = torch.zeros(H)
            for e, p in route.items():
                y = y + p * _expert(config, w, e, x[s, b])
            if w.shared_fc1 is not None:
                y = y + _shared(config, w, x[s, b])
            rows[s, b] = y
            if padding is None or not padding[b, s]:
                for e in route:
                    counts[e] += 1
        valid = [t for t in tokens if padding is None or not padding[t[1], t[0]]]
        squares = [torch.logsumexp(logits[t], dim=0) ** 2 for t in valid]
        mean = sum(squares) / max(len(valid), 1)
        z_logged.append(float(mean.detach()) if torch.is_tensor(mean) else float(mean))
        if config.moe_z_loss_coeff:
            z_terms.append(mean * config.moe_z_loss_coeff / chunks)
    aux, logged = _balance_losses(config, all_logits, S, B, padding)
    out = torch.stack([torch.stack([rows[s, b] for b in range(B)]) for s in range(S)])
    return out, aux + sum(z_terms), logged, counts, z_logged


def _balance_losses(config, logits: dict, S: int, B: int, padding: Optional[torch.Tensor]):
    kind, coeff = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    if kind == "none" or not coeff:
        return 0.0, {}
    valid = {t: l for t, l in logits.items() if padding is None or not padding[t[1], t[0]]}
    scores = {t: _aux_scores(config, l) for t, l in valid.items()}
    if kind == "aux_loss":
        loss = _switch_loss(config, list(scores.values()), len(valid), coeff)
        return loss, {"load_balancing_loss": float(loss) / coeff}
    # seq_aux_loss: each sequence's loss with the replica's mean count of real tokens per sequence.
    per_sequence = len(valid) / B
    loss = sum(_switch_loss(config, [s for t, s in scores.items() if t[1] == b], per_sequence, coeff)
               for b in range(B)) / B
    return loss, {"seq_load_balancing_loss": float(loss) / coeff}


def reference(config, w: Weights, x: torch.Tensor, chunks: int = 1, padding: Optional[torch.Tensor] = None
              ) -> Result:
    """The layer on x [R, S, B, H] (padding [R, B, S], True = padding) with the weights `w`;
    differentiable in `x` and the weights."""
    outputs, aux, logged, counts, z_logged = [], 0.0, [], [0] * config.num_moe_experts, []
    for r in range(x.shape[0]):
        out, loss, values, c, z = _replica(config, w, x[r], chunks, None if padding is None else padding[r])
        outputs.append(out)
        aux = aux + loss
        logged.append(values)
        counts = [a + b for a, b in zip(counts, c)]
        z_logged += z
    mean = {name: sum(v[name] for v in logged) / len(logged) for name in logged[0]}
    if config.moe_z_loss_coeff:
        mean["z_loss"] = sum(z_logged) / len(z_logged)
    return Result(torch.stack(outputs), aux if torch.is_tensor(aux) else torch.tensor(0.0), mean, counts)


def reference_grads(config, w: Weights, x: torch.Tensor, grad_out: torch.Tensor, chunks: int = 1,
                    padding: Optional[torch.Tensor] = None):
    """(Result, {"input": dx, <parameter name>: gradient}) of <output, grad_out> + the auxiliary losses."""
    leaves = {name: t.detach().clone().requires_grad_(True) for name, t in w.named().items()}
    by_field = {"router.weight": "router", "experts.linear_fc1.weight": "fc1", "experts.linear_fc2.weight": "fc2",
                "shared_experts.linear_fc1.weight": "shared_fc1", "shared_experts.linear_fc2.weight": "shared_fc2",
                "shared_experts.gate_weight": "shared_gate"}
    w_leaf = dataclasses.replace(w, **{by_field[n]: t for n, t in leaves.items()})
    x = x.detach().clone().requires_grad_(True)
    result = reference(config, w_leaf, x, chunks, padding)
    objective = (result.output * grad_out).sum() + result.aux_loss
    grads = torch.autograd.grad(objective, [x, *leaves.values()], allow_unused=True)
    named = {"input": grads[0]}
    named.update({n: (g if g is not None else torch.zeros_like(leaves[n])) for n, g in zip(leaves, grads[1:])})
    result.output = result.output.detach()
    return result, named
