"""Megatron-Core torch_dist checkpoints <-> ours (tools/checkpoint/convert.py --loader/--saver
mcore), against tests/data/mcore_torch_dist, which megatron-core 0.19.2 itself wrote (a GPT with its
local spec: RMSNorm, SwiGLU, GQA, RoPE, untied) with the logits its own forward gave: converted,
our GPT gives those logits at TP 1 and 2; converted back, the checkpoint holds Megatron-Core's keys,
shapes, dtypes and values; and, where megatron-core is importable, Megatron-Core loads our export
and gives the same logits."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from helpers import converted_logits, run_convert

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIXTURE = os.path.join(HERE, "data", "mcore_torch_dist")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the tests' own DCP calls


def _convert(loader, saver, load_dir, save_dir, *extra, expect_ok=True):
    code, stdout, stderr = run_convert("--model-type", "GPT", "--loader", loader, "--saver", saver,
                                       "--load-dir", load_dir, "--save-dir", save_dir, *extra)
    assert (code == 0) == expect_ok, stdout + stderr
    return SimpleNamespace(returncode=code, stdout=stdout, stderr=stderr)


def _tensors(iter_dir):
    """Every tensor of a torch_dist checkpoint, whole, read by plain DCP: {key: tensor}."""
    metadata = dcp.FileSystemReader(iter_dir).read_metadata().state_dict_metadata
    out = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in metadata.items()
           if isinstance(md, TensorStorageMetadata)}
    dcp.load(out, checkpoint_id=iter_dir, no_dist=True)
    return out, metadata


def test_megatron_core_checkpoint_gives_its_logits_in_ours_at_tp_1_and_2(pools, tmp_path):
    ours = tmp_path / "ours"
    out = _convert("mcore", "megatron_fsdp", FIXTURE, ours).stdout
    assert "vocabulary 100" in out and "--num-query-groups 2 --kv-channels 8 --swiglu --normalization RMSNorm" in out
    expected = torch.load(os.path.join(FIXTURE, "expected.pt"), weights_only=True)
    for tp in (1, 2):
        logits = pools(tp).run(converted_logits, str(ours), tp, expected["ids"], 100)[0]
        # Megatron-Core's own forward on its own weights; ours agree to fp32 rounding.
        torch.testing.assert_close(logits, expected["logits"], atol=2e-6, rtol=1e-5, msg=lambda m: f"TP={tp}: {m}")


def test_ours_converted_back_is_megatron_cores_checkpoint(tmp_path):
    ours, back = tmp_path / "ours", tmp_path / "back"
    _convert("mcore", "megatron_fsdp", FIXTURE, ours)
    out = _convert("megatron_fsdp", "mcore", ours, back).stdout
    assert os.path.join(str(back), "iter_0000000") in out
    assert open(back / "latest_checkpointed_iteration.txt").read().strip() == "0"
    assert open(back / "iter_0000000" / "metadata.json").read() == open(
        os.path.join(FIXTURE, "iter_0000003", "metadata.json")).read()
    theirs, their_metadata = _tensors(os.path.join(FIXTURE, "iter_0000003"))
    mine, my_metadata = _tensors(str(back / "iter_0000000"))
    # Tensors, per-layer extra state, common state; and, for a Transformer Engine spec, its core
    # attention's extra state (a local-spec model such as the fixture's has none).
    te_only = {f"decoder.layers.self_attention.core_attention._extra_state/shard_{i}_2" for i in range(2)}
    assert set(my_metadata) == set(their_metadata) | te_only
    assert mine.keys() == theirs.keys()
    for key in theirs:
        assert mine[key].dtype == theirs[key].dtype and mine[key].shape == theirs[key].shape, key
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            # The rows past the vocabulary are padding: Megatron-Core's hold its initial draws, ours zeros.
            assert torch.equal(mine[key][:100], theirs[key][:100]) and not mine[key][100:].any(), key
        else:
            assert torch.equal(mine[key], theirs[key]), key
    from megatron_fsdp.dist_checkpointing.mcore import McoreReader

    common = McoreReader(str(back)).common
    assert (common["iteration"], common["checkpoint_version"]) == (0, 3.0)
    assert vars(common["args"])["num_query_groups"] == 2 and vars(common["args"])["padded_vocab_size"] == 128


def test_saver_pads_the_vocabulary_for_the_target_tp_and_bf16(tmp_path):
    ours, back = tmp_path / "ours", tmp_path / "back"
    _convert("mcore", "megatron_fsdp", FIXTURE, ours)
    _convert("megatron_fsdp", "mcore", ours, back, "--target-tensor-parallel-size", "2", "--saver-dtype", "bf16")
    mine, _ = _tensors(str(back / "iter_0000000"))
    theirs, _ = _tensors(os.path.join(FIXTURE, "iter_0000003"))
    embedding = mine["embedding.word_embeddings.weight"]
    assert embedding.shape == (256, 32) and embedding.dtype == torch.bfloat16
    assert torch.equal(embedding[:100], theirs["embedding.word_embeddings.weight"][:100].bfloat16())
    assert not embedding[100:].any()


def test_what_is_not_a_megatron_core_checkpoint_is_one_line(tmp_path):
    def refused(load_dir, match):
        proc = _convert("mcore", "megatron_fsdp", load_dir, tmp_path / "out", expect_ok=False)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and match in lines[0], proc.stderr
        assert not (tmp_path / "out").exists()

    refused(tmp_path, "has no latest_checkpointed_iteration.txt")
    copy = tmp_path / "copy"
    shutil.copytree(FIXTURE, copy)
    with open(copy / "iter_0000003" / "metadata.json", "w") as f:
        f.write('{"sharded_backend": "zarr"}')
    refused(copy, "sharded_backend 'zarr'; only torch_dist is read")


def _have_megatron_core() -> bool:
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


@pytest.mark.skipif(not _have_megatron_core(),
                    reason="megatron-core is not importable here (scripts/cuda_build_check.sh runs this with it)")
def test_megatron_core_loads_our_export_with_the_same_logits(tmp_path):
    ours, back = tmp_path / "ours", tmp_path / "back"
    _convert("mcore", "megatron_fsdp", FIXTURE, ours)
    _convert("megatron_fsdp", "mcore", ours, back)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "data", "make_mcore_checkpoint.py"), "--check-load",
                           str(back / "iter_0000000")], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MCORE_PORT="29563"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # Against the fixture's checkpoint loaded in the same process: the same weights, bit for bit.
    assert "max logits difference: 0.0\n" in proc.stdout, proc.stdout[-2000:]
    # Against the logits Megatron-Core computed when it wrote the fixture, on another machine.
    from_expected = float(re.search(r"max logits difference from expected.pt: (\S+)", proc.stdout)[1])
    assert from_expected < 2e-5, proc.stdout[-2000:]


@pytest.mark.e2e  # the documented commands (docs/checkpoints.md), launched as a user runs them
def test_documented_megatron_core_commands_run_as_written(tmp_path):
    with open(os.path.join(ROOT, "docs", "checkpoints.md")) as f:
        section = f.read().split("## From and to Hugging Face", 1)[1].split("\n## ", 1)[0]
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S) if "--loader mcore" in b]
    shutil.copytree(FIXTURE, tmp_path / "mcore-ckpt")
    os.symlink(os.path.join(ROOT, "tools"), tmp_path / "tools")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    mine, _ = _tensors(str(tmp_path / "mcore-ckpt-back" / "iter_0000000"))
    assert mine["embedding.word_embeddings.weight"].shape == (256, 32)  # padded for TP 2


def test_loading_a_megatron_core_checkpoint_directly_names_the_converter(tmp_path):
    from megatron_fsdp.training.checkpointing import CheckpointError, load_checkpoint

    with pytest.raises(CheckpointError, match="is a Megatron-Core distributed checkpoint: convert it with "
                                              "tools/checkpoint/convert.py --loader mcore"):
        load_checkpoint(torch.nn.Linear(2, 2), None, None, FIXTURE, load_optim=False, verify=False)
