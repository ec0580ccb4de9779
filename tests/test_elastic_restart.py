"""Restart after a crash: `torchrun --max-restarts N ... --load D --save D` (docs/faults.md).

torchrun's agent keeps its rendezvous store, with every key the crashed attempt
wrote, when it starts new workers; each attempt forms its groups under a prefix
of its own that its ranks agree on (training/rendezvous.py, attempt_store and
agree_on_attempt). The handshake itself is checked here in one process, with the
store's leftovers of earlier attempts; the jobs run as a user runs them, under
torchrun, with the crash injected by tests/pretrain_with_crash.py: one rank
SIGKILLed mid-run on one node, a lost node (its torchrun and its workers) that
is started again, and a restarted attempt one of whose ranks never comes.
What a resumed run computes is compared with an uninterrupted run: its losses
as printed, and its last checkpoint's tensors bit for bit.
"""

import glob
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from job_output import assert_one_line_error, error_lines
from pretrain_in_pool import pretrain_gpt_job, with_shared_mock_indices

from megatron_fsdp.training import rendezvous
from megatron_fsdp.training.rendezvous import StartupError, agree_on_attempt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "pretrain_with_crash.py")
# The tiny GPT of tests/test_training_faults.py, dropout on: a resume restores the RNG states too.
FLAGS = ["--use-torch-fsdp2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
         "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3", "--hidden-dropout", "0.1",
         "--attention-dropout", "0.1", "--mock-data", "--vocab-size", "64", "--log-interval", "1", "--eval-iters", "0",
         "--num-workers", "0"]
ITERS, SAVE_INTERVAL, CRASH_AT = 6, 2, 5  # checkpoints at 2 and 4, the crash as 5 starts: resume from 4
LOSS = re.compile(r"iteration\s+(\d+)/.*\| lm loss: ([\d.E+-]+) \|")
JOB_TIMEOUT_S = 240


def _losses(out: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in map(LOSS.search, out.splitlines()) if m}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _tensors(checkpoint: str) -> dict[str, torch.Tensor]:
    """Every tensor a DCP checkpoint holds (weights, optimizer states), read in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(checkpoint).read_metadata()
    state = {name: torch.empty(m.size, dtype=m.properties.dtype)
             for name, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    return state


def _assert_same_tensors(checkpoint: str, reference: str) -> None:
    mine, theirs = _tensors(checkpoint), _tensors(reference)
    assert mine.keys() == theirs.keys()
    differ = [name for name in mine if not torch.equal(mine[name], theirs[name])]
    assert not differ, f"{len(differ)} tensors differ from the uninterrupted run's: {differ[:5]}"


def _kill_tree(proc: subprocess.Popen) -> None:
    """A launcher left running by a failed test, with its workers (each in a session of its own)."""
    if proc.poll() is not None:
        return
    try:
        children = _read(f"/proc/{proc.pid}/task/{proc.pid}/children").split()
    except OSError:
        children = []
    for pid in [proc.pid, *map(int, children)]:
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def _launch(launcher: list[str], args: list[str], env: dict, out: str, script: str = SCRIPT) -> subprocess.Popen:
    """torchrun `launcher` `script` FLAGS `args`, stdout and stderr to the files out.out and out.err."""
    with open(out + ".out", "w") as stdout, open(out + ".err", "w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launcher, script,
                                 *with_shared_mock_indices([*FLAGS, *args])],
                                cwd=ROOT, env=dict(os.environ, **env), stdout=stdout, stderr=stderr,
                                start_new_session=True)


def _finish(proc: subprocess.Popen, out: str, deadline: float) -> tuple[int, str, str]:
    """Wait for a launch until `deadline` (then it and its workers are killed and the test fails):
    (exit code, stdout, stderr)."""
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        pytest.fail(f"{out}: still running after the test's deadline:\n{_read(out + '.err')[-4000:]}")
    return proc.returncode, _read(out + ".out"), _read(out + ".err")


# ------------------------------------------------------------------ the handshake, in one process

class _Ranks:
    """`world` ranks of one attempt as threads on one store: `start(rank, delay)`, then `results()`."""

    def __init__(self, store, world: int, timeout: float):
        self.store, self.world, self.timeout = store, world, timedelta(seconds=timeout)
        self.outcome: dict[int, object] = {}
        self.threads = []

    def start(self, rank: int, delay: float = 0.0) -> None:
        def run():
            time.sleep(delay)
            try:
                self.outcome[rank] = agree_on_attempt(self.store, rank, self.world, self.timeout)
            except Exception as exc:  # noqa: BLE001  (the test looks at it)
                self.outcome[rank] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def results(self) -> dict:
        for thread in self.threads:
            thread.join(timeout=30)
        return dict(self.outcome)


@pytest.fixture
def agent_store():
    """A TCPStore as torchrun's agent hosts it, and a client for the ranks."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


def test_every_rank_of_an_attempt_agrees_on_a_fresh_name_whatever_the_earlier_attempts_left(agent_store, monkeypatch):
    """Attempt 1 finishes its handshake; attempt 2 dies in the middle of its own (rank 2 asked, rank 0
    never answered); attempt 3 starts its ranks in any order, rank 0 last but one: every rank
    gets one name, never an earlier attempt's, and the handshake leaves no key of its own behind."""
    monkeypatch.setattr(rendezvous, "_LATE_REPORT_S", 0.0)
    world = 4
    first = _Ranks(agent_store, world, timeout=10)
    for rank in range(world):
        first.start(rank)
    names = first.results()
    assert len(set(names.values())) == 1 and all(isinstance(n, str) for n in names.values()), names
    (earlier,) = set(names.values())

    agent_store.append(f"{rendezvous._HANDSHAKE}/log", "2:0123456789abcdef;")  # the dead attempt's rank 2
    agent_store.add(f"{rendezvous._HANDSHAKE}/count", 1)

    third = _Ranks(agent_store, world, timeout=10)
    for rank, delay in ((3, 0.0), (1, 0.05), (0, 0.2), (2, 0.4)):
        third.start(rank, delay)
    names = third.results()
    assert len(set(names.values())) == 1 and all(isinstance(n, str) for n in names.values()), names
    assert earlier not in names.values()
    assert not agent_store.check([f"{rendezvous._HANDSHAKE}/log"])
    assert not agent_store.check([f"{rendezvous._HANDSHAKE}/answer/0123456789abcdef"])


def test_a_rank_that_never_comes_is_one_line_on_rank_zero_and_a_rank_zero_that_never_comes_one_on_the_others(
        agent_store, monkeypatch):
    monkeypatch.setattr(rendezvous, "_LATE_REPORT_S", 0.0)
    started = time.monotonic()
    ranks = _Ranks(agent_store, 3, timeout=0.5)
    ranks.start(0)
    ranks.start(1)  # rank 2 never comes
    outcome = ranks.results()
    assert time.monotonic() - started < 5
    assert isinstance(outcome[0], StartupError)
    assert str(outcome[0]) == ("rank 2 of this attempt did not join its process group within 0.5 s "
                               "(--distributed-timeout-minutes): not started, or stuck before start-up; see its output")
    # Rank 1 got its answer and went on, to wait in init_process_group (torchrun stops it once rank 0 failed).
    assert isinstance(outcome[1], str)

    ranks = _Ranks(agent_store, 2, timeout=0.5)
    ranks.start(1)  # rank 0 never comes
    (outcome,) = ranks.results().values()
    assert isinstance(outcome, StartupError) and str(outcome) == (
        "rank 0 of this attempt did not answer within 0.5 s (--distributed-timeout-minutes): not started, or stuck "
        "before start-up; see its output"), outcome


# ------------------------------------------------------------------ the jobs, under torchrun

@pytest.fixture(scope="module")
def reference(tmp_path_factory, pools):
    """The uninterrupted run on 2 ranks (the worker pool's: what a job computes, not the
    launcher), with the crashed runs' checkpoints: its losses and its last checkpoint."""
    ckpt = str(tmp_path_factory.mktemp("reference") / "ckpt")
    outcomes = pools(2).run(pretrain_gpt_job, [*FLAGS, "--train-iters", str(ITERS), "--save", ckpt,
                                               "--save-interval", str(SAVE_INTERVAL)], timeout=400)
    out = "".join(text for _, text in outcomes)
    assert [code for code, _ in outcomes] == [0, 0], out[-3000:]
    losses = _losses(out)
    assert sorted(losses) == list(range(1, ITERS + 1)), out[-3000:]
    return losses, os.path.join(ckpt, f"iter_{ITERS:07d}")


@pytest.mark.e2e
@pytest.mark.restart  # a step of its own in CI (scripts/run_tests.sh --step restart)
@pytest.mark.parametrize("save", ["sync", "async"])
def test_a_rank_killed_mid_run_restarts_from_the_latest_checkpoint_with_the_uninterrupted_losses(tmp_path, reference,
                                                                                                  save):
    """torchrun --max-restarts 1, --load D --save D: rank 1 is SIGKILLed as iteration 5 starts
    (checkpoints at 2 and 4). torchrun stops rank 0 and starts both again; the new attempt forms
    its groups, loads iteration 4, and iterations 5-6 and the last checkpoint are the
    uninterrupted run's, bit for bit. The job exits 0. With --async-save, iteration 4's checkpoint
    may still be in its background write when the rank dies: the new attempt then loads 2."""
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "job")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    proc = _launch(["--nproc-per-node", "2", "--max-restarts", "1"],
                   ["--train-iters", str(ITERS), "--load", ckpt, "--save", ckpt, "--save-interval", str(SAVE_INTERVAL),
                    *(["--async-save"] if save == "async" else [])],
                   dict(CRASH_RANK="1", CRASH_ITERATION=str(CRASH_AT)), out)
    code, stdout, stderr = _finish(proc, out, deadline)
    assert code == 0, stderr[-4000:]
    assert "failed (exitcode: " in stderr, stderr[-4000:]  # torchrun saw the attempt fail (-9, or rank 0 first)
    loaded = [CRASH_AT - 1] if save == "sync" else [CRASH_AT - 1, CRASH_AT - 1 - SAVE_INTERVAL]
    assert any(f"loaded checkpoint from {ckpt} at iteration {k}" in stdout for k in loaded), stdout[-3000:]
    losses, reference_ckpt = reference
    assert _losses(stdout) == losses, stdout[-3000:]  # 1-4 before the crash, 5-6 after it
    _assert_same_tensors(os.path.join(ckpt, f"iter_{ITERS:07d}"), reference_ckpt)


@pytest.mark.e2e
@pytest.mark.restart  # a step of its own in CI (scripts/run_tests.sh --step restart)
def test_a_lost_node_started_again_rejoins_and_the_job_finishes_with_the_uninterrupted_losses(tmp_path):
    """Two torchrun "nodes" (c10d rendezvous, --max-restarts 1, one process each; docs/faults.md's
    two-node form). As iteration 5 starts (checkpoints at 2 and 4) node 1 is lost: its torchrun and
    its worker SIGKILLed. Node 0's worker fails in its next collective, node 0's agent waits in
    the rendezvous, node 1's torchrun is started again (as a scheduler replaces a node), and the
    new round resumes from iteration 4: both torchruns exit 0, with the losses and last checkpoint
    of the same two-node job run without a fault. (The two nodes count their restarts differently:
    node 0 is at its first restart, node 1's new agent at none.)

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch's default a node that joins in a later round
    waits for the workers' store address that the surviving rank-0 agent published in the first
    round only (torch 2.13's DynamicRendezvousHandler.next_rendezvous keeps it), and the
    rendezvous fails after its timeout."""
    pause = tmp_path / "pause"
    pause.mkdir()
    ports = {"reference": _free_port(), "job": _free_port()}

    def node(name: str, ckpt: str, env: dict, restarts: str = "1") -> subprocess.Popen:
        job, number = name.split("_")
        # Node 0 is the --rdzv-endpoint's machine: it hosts the rendezvous (on one machine either
        # torchrun could). A lost node's heartbeat is missed within 3 s (torch: 15); a rendezvous
        # that cannot complete fails within a minute (torch: 10).
        conf = f"is_host={int(number == '0')},join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3"
        return _launch(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"127.0.0.1:{ports[job]}", "--rdzv-id", job, "--rdzv-conf", conf,
                        "--max-restarts", restarts],
                       ["--train-iters", str(ITERS), "--load", ckpt, "--save", ckpt,
                        "--save-interval", str(SAVE_INTERVAL)],
                       dict(env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), str(tmp_path / name))

    deadline = time.monotonic() + 2 * JOB_TIMEOUT_S
    # The same job without a fault: in this layout (one process per node) each rank has all the
    # machine's cores, and its losses are this layout's.
    ref_ckpt = str(tmp_path / "reference_ckpt")
    plain = [node("reference_0", ref_ckpt, {}, "0"), node("reference_1", ref_ckpt, {}, "0")]
    finished = [_finish(p, str(tmp_path / f"reference_{i}"), deadline) for i, p in enumerate(plain)]
    assert [f[0] for f in finished] == [0, 0], "".join(f[2][-3000:] for f in finished)
    reference = _losses("".join(f[1] for f in finished))
    assert sorted(reference) == list(range(1, ITERS + 1))

    ckpt = str(tmp_path / "ckpt")
    env = dict(PAUSE_ITERATION=str(CRASH_AT), PAUSE_DIR=str(pause))
    nodes = [node("job_0", ckpt, env), node("job_1", ckpt, env)]
    try:
        while len(glob.glob(str(pause / "paused_*"))) < 2:
            assert all(n.poll() is None for n in nodes), [n.returncode for n in nodes]
            assert time.monotonic() < deadline, "the job never reached iteration 5"
            time.sleep(0.1)
        workers = [_read(p).split() for p in glob.glob(str(pause / "paused_*"))]
        lost = [int(pid) for pid, launcher in workers if int(launcher) == nodes[1].pid]
        assert len(lost) == 1, workers
        for pid in [nodes[1].pid, *lost]:  # the node is gone: its torchrun and its worker
            os.kill(pid, signal.SIGKILL)
        nodes[1].wait()
        (pause / "go").touch()  # node 0's worker goes on, into a collective with the dead
        replaced = node("job_1b", ckpt, env)
        results = {name: _finish(p, str(tmp_path / name), deadline)
                   for name, p in (("job_0", nodes[0]), ("job_1b", replaced))}
    finally:
        for p in nodes:
            _kill_tree(p)
        if "replaced" in locals():
            _kill_tree(replaced)
    stderr = "".join(r[2] for r in results.values())
    assert [r[0] for r in results.values()] == [0, 0], stderr[-5000:]
    stdout = _read(str(tmp_path / "job_1.out")) + "".join(r[1] for r in results.values())
    assert f"loaded checkpoint from {ckpt} at iteration {CRASH_AT - 1}" in stdout, stdout[-3000:]
    assert _losses(stdout) == reference, stdout[-3000:]
    _assert_same_tensors(os.path.join(ckpt, f"iter_{ITERS:07d}"), os.path.join(ref_ckpt, f"iter_{ITERS:07d}"))


@pytest.mark.e2e
@pytest.mark.restart  # a step of its own in CI (scripts/run_tests.sh --step restart)
def test_a_restarted_attempt_whose_rank_never_comes_fails_in_one_line_within_its_timeout(tmp_path):
    """Attempt 0: rank 1 dies before start-up. Attempt 1: rank 1 is stuck before start-up (it
    sleeps). Rank 0 waits for it --distributed-timeout-minutes (here 6 s), not longer, and the
    job ends with one line naming rank 1 (torchrun stops the sleeper), exit code 1."""
    out = str(tmp_path / "job")
    started = deadline = time.monotonic()
    deadline += JOB_TIMEOUT_S
    proc = _launch(["--nproc-per-node", "2", "--max-restarts", "1"],
                   ["--train-iters", "2", "--distributed-timeout-minutes", "0.1"],
                   dict(CRASH_RANK="1", CRASH_ITERATION="0", STALL_RANK="1", STALL_ATTEMPT="1", STALL_SECONDS="600"),
                   out)
    code, _, stderr = _finish(proc, out, deadline)
    assert code == 1, stderr[-4000:]
    assert time.monotonic() - started < 120, "it waited for the sleeper"
    assert len(error_lines(stderr)) == 1, stderr[-4000:]
    assert assert_one_line_error(stderr, "StartupError: rank 1 of this attempt did not join its process group within "
                                         "6 s (--distributed-timeout-minutes)", same_everywhere=False) == 0
