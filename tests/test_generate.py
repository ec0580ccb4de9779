"""examples/generate_gpt.py: sampling rules, and generation from a checkpoint at another layout."""

import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import generate_gpt  # noqa: E402

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "64"]


def test_top_k_keeps_the_k_most_likely_tokens():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5, 2.5])
    probs = generate_gpt.sampling_probabilities(logits, top_k=3, temperature=2.0)
    kept = torch.exp(torch.tensor([3.0, 2.0, 2.5]) / 2.0)
    expected = torch.zeros(5)
    expected[[1, 2, 4]] = kept / kept.sum()
    torch.testing.assert_close(probs, expected)


def test_top_p_keeps_the_most_likely_tokens_until_their_probability_exceeds_p():
    probs_in = torch.tensor([0.1, 0.5, 0.25, 0.15])
    logits = probs_in.log()
    # Sorted: 0.5, 0.25, 0.15, 0.1; cumulative 0.5, 0.75, 0.9, 1.0. p=0.7: keep 0.5 and 0.25 (the first past 0.7).
    probs = generate_gpt.sampling_probabilities(logits, top_p=0.7)
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.5, 0.25, 0.0]) / 0.75)
    # p=0.4: the most likely token alone already exceeds it.
    torch.testing.assert_close(generate_gpt.sampling_probabilities(logits, top_p=0.4),
                               torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_greedy_and_seeded_sampling():
    logits = torch.tensor([0.0, 5.0, 1.0])
    assert generate_gpt.next_token(logits, 0, 0.0, 1.0, True, None) == 1
    assert generate_gpt.next_token(logits, 1, 0.0, 1.0, False, None) == 1
    draws = [generate_gpt.next_token(torch.zeros(50), 0, 0.0, 1.0, False, torch.Generator().manual_seed(s))
             for s in range(20)]
    assert len(set(draws)) > 5  # sampling, not argmax
    again = [generate_gpt.next_token(torch.zeros(50), 0, 0.0, 1.0, False, torch.Generator().manual_seed(s))
             for s in range(20)]
    assert draws == again


@pytest.mark.parametrize("kwargs, match", [(dict(top_k=4, top_p=0.5), "exclude each other"),
                                           (dict(greedy=True, top_p=0.5), "--greedy excludes"),
                                           (dict(temperature=0.0), "--temperature > 0")])
def test_bad_sampling_flags(kwargs, match):
    flags = dict(top_k=0, top_p=0.0, temperature=1.0, greedy=False)
    flags.update(kwargs)
    with pytest.raises(ValueError, match=match):
        generate_gpt.check_sampling_args(**flags)


def _torchrun(nproc: int, script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           os.path.join(ROOT, "examples", script), *MODEL, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.e2e
def test_generation_from_a_checkpoint_at_another_tensor_parallel_size(tmp_path):
    """Trained at TP=1 on mock data (documents counting up, modulo the
    vocabulary), generated at TP=2 and TP=1: the model counts on, and greedy
    decoding gives the same tokens in both layouts."""
    ckpt = str(tmp_path / "ckpt")
    _torchrun(1, "pretrain_gpt.py", "--micro-batch-size", "8", "--lr", "1e-2", "--train-iters", "40", "--mock-data",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0", "--num-workers", "0",
              "--log-interval", "40", "--save", ckpt)
    outputs = []
    for nproc, tp in ((2, "2"), (1, "1")):
        out = _torchrun(nproc, "generate_gpt.py", "--tensor-model-parallel-size", tp, "--load", ckpt,
                        "--prompts", "5 6 7 8", "--num-tokens-to-generate", "6", "--greedy")
        assert "> prompt: '5 6 7 8'" in out
        outputs.append([int(t) for t in re.search(r"> generated: '([\d ]*)'", out)[1].split()])
    assert outputs[0] == outputs[1], outputs
    counted_on = sum(token == previous + 1 for previous, token in zip([8] + outputs[0], outputs[0]))
    assert len(outputs[0]) == 6 and counted_on >= 5, outputs[0]
