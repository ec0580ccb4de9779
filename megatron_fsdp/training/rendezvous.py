"""A restarted torchrun attempt forms its process groups afresh.

With `torchrun --max-restarts N`, torchrun's agent hosts the rendezvous
store (TORCHELASTIC_USE_AGENT_STORE=True) and keeps it, with every key the
previous attempt wrote, when it starts new workers; torch names the keys of
each group alike in every attempt (gloo's and NCCL's addresses under
"<group>/<device>/..."), so a restarted rank could read a dead rank's address
(`Gloo connectFullMesh failed ... Connection refused`), and megatron_fsdp's own
keys (the one-line error's election, the progress beacon) the dead ranks' state.
Each attempt's groups live under a prefix of their own (`attempt_store`), which rank 0 draws afresh
and hands to every rank that asks with a fresh nonce: TORCHELASTIC_RESTART_COUNT
cannot name the attempt, each node's agent counts its own restarts.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch.distributed as dist


class StartupError(RuntimeError):
    """The ranks of this attempt could not meet to form their process group."""


ATTEMPT_PREFIX = "megatron_fsdp/attempt"
_HANDSHAKE = f"{ATTEMPT_PREFIX}/handshake"
_POLL_S = (0.002, 0.25)  # first and longest pause between two looks at the store
_LATE_REPORT_S = 5.0  # how much later than its node's first one the other ranks say that rank 0 never answered


def uses_torchrun_agent_store() -> bool:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT is torchrun's agent's, kept across
    restarts (what torch's env:// rendezvous reads: torchrun sets it for its workers, and
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 turns it off, rank 0 then hosting a store of its own
    in each attempt)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def attempt_store(timeout: timedelta) -> tuple:
    """(store, rank, world_size) for this attempt's process group: torchrun's rendezvous store
    (torch's env:// rendezvous), under a prefix that every rank of this attempt shares and no
    earlier attempt used (`agree_on_attempt`). Every group made later (the model-parallel
    groups, DeviceMeshes, the checkpoint manager's) and every key megatron_fsdp writes (the
    one-line error's election, the progress beacon, the shutdown) live under it."""
    try:
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        store.set_timeout(timeout)
    except (dist.DistError, ValueError) as exc:
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise StartupError(f"cannot reach torchrun's rendezvous store at {where} within "
                           f"{timeout.total_seconds():g} s ({type(exc).__name__}: {_first_line(exc)})") from exc
    token = agree_on_attempt(store, rank, world_size, timeout)
    return dist.PrefixStore(f"{ATTEMPT_PREFIX}/{token}", store), rank, world_size


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or ["(no message)"])[0][:300]


def _poll(until, deadline: float) -> bool:
    """Look at the store (`until()`) with growing pauses until it says True; False at `deadline`."""
    pause = _POLL_S[0]
    while not until():
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, _POLL_S[1])
    return True


def agree_on_attempt(store, rank: int, world_size: int, timeout: timedelta) -> str:
    """A name that every rank of this attempt shares and no earlier attempt used, agreed on
    `store` (torchrun's agent's, which holds what every earlier attempt wrote).

    TORCHELASTIC_RESTART_COUNT cannot be that name: each node's agent counts its own restarts
    (a node whose workers were stopped because a peer node failed, or a replaced node's new
    agent, counts differently). And a rank cannot tell a value this attempt's rank 0 wrote from
    one an earlier rank 0 wrote under the same key. So: each rank r > 0 draws a nonce, appends
    "r:nonce" to a log and waits for the answer under a key named by its nonce, which no
    earlier attempt can have written; rank 0 draws the token, answers the latest nonce of
    each rank (a stale one too, harmlessly, until the rank's own arrives), and waits until
    every rank has said, under the token, that it has it. Then the handshake's keys go (every
    rank of this attempt has read its answer); a failed attempt's are answered and dropped
    by the next. Within `timeout` (--distributed-timeout-minutes), or StartupError in one line:
    on rank 0 naming the ranks that never came, on the others saying that rank 0 did not answer.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    log, count = f"{_HANDSHAKE}/log", f"{_HANDSHAKE}/count"
    try:
        if rank != 0:
            return _ask_for_attempt(store, rank, log, count, timeout, deadline)
        if world_size == 1:
            return uuid.uuid4().hex
        return _answer_attempt(store, world_size, log, count, timeout, deadline)
    except dist.DistError as exc:  # the store itself failed (its agent is gone, say)
        raise StartupError(f"torchrun's rendezvous store failed while this attempt's ranks met "
                           f"({type(exc).__name__}: {_first_line(exc)})") from exc


def _ask_for_attempt(store, rank: int, log: str, count: str, timeout: timedelta, deadline: float) -> str:
    nonce = uuid.uuid4().hex
    answer = f"{_HANDSHAKE}/answer/{nonce}"
    store.append(log, f"{rank}:{nonce};")
    store.add(count, 1)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank != (1 if rank == local_rank else 0):
        # The node's first process but rank 0 says it; torchrun then stops the others before they do.
        deadline += _LATE_REPORT_S
    if not _poll(lambda: store.check([answer]), deadline):
        raise StartupError(f"rank 0 of this attempt did not answer within {timeout.total_seconds():g} s "
                           "(--distributed-timeout-minutes): not started, or stuck before start-up; see its output")
    token = store.get(answer).decode()
    store.set(f"{ATTEMPT_PREFIX}/{token}/joined/{rank}", "1")
    store.add(f"{ATTEMPT_PREFIX}/{token}/joined", 1)
    return token


def _answer_attempt(store, world_size: int, log: str, count: str, timeout: timedelta, deadline: float) -> str:
    token = uuid.uuid4().hex
    joined = f"{ATTEMPT_PREFIX}/{token}/joined"
    answered: dict[int, str] = {}  # each rank's latest nonce answered
    written: list[str] = []  # every answer, a stale nonce's too
    seen = [None]

    def everyone_joined() -> bool:
        arrivals = store.add(count, 0)
        if arrivals != seen[0]:  # new entries in the log: answer each rank's latest nonce
            seen[0] = arrivals
            latest = {}
            for entry in (store.get(log).decode() if store.check([log]) else "").split(";"):
                r, _, nonce = entry.partition(":")
                if nonce and r.isdigit() and 0 < int(r) < world_size:
                    latest[int(r)] = nonce
            fresh = {r: nonce for r, nonce in latest.items() if answered.get(r) != nonce}
            if fresh:
                keys = [f"{_HANDSHAKE}/answer/{nonce}" for nonce in fresh.values()]
                store.multi_set(keys, [token] * len(keys))
                answered.update(fresh)
                written.extend(keys)
        return store.add(joined, 0) >= world_size - 1

    if not _poll(everyone_joined, deadline):
        missing = [r for r in range(1, world_size) if not store.check([f"{joined}/{r}"])]
        named = ", ".join(map(str, missing[:8])) + (f", ... ({len(missing)} ranks)" if len(missing) > 8 else "")
        who = f"rank{'s' if len(missing) > 1 else ''} {named}" if missing else "not every rank"
        raise StartupError(f"{who} of this attempt did not join its process group within "
                           f"{timeout.total_seconds():g} s (--distributed-timeout-minutes): not started, or stuck "
                           f"before start-up; see {'their' if len(missing) > 1 else 'its'} output")
    for key in (log, count, *written):
        store.delete_key(key)
    return token
