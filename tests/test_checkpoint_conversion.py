"""tools/checkpoint/convert.py between Hugging Face directories and our checkpoints, against
`transformers`: a tiny random Llama (GQA, untied), Qwen2 (q/k/v biases, tied) and a Llama 3.1
(rope scaling) saved by `transformers` convert to our checkpoint, which loads at TP 1 and 2 with
the HF logits and whose stored flags build the model (--use-checkpoint-args); converted back they
are the same files' tensors bit for bit; a model trained at TP 2 x DP 2 by pretrain_gpt.py exports
to a directory `transformers` loads with our logits; bad inputs are one line, nothing written."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from helpers import converted_logits, run_convert
from test_hf_interchange import _hf_model

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _convert(*args, expect_ok=True):
    code, stdout, stderr = run_convert("--model-type", "GPT", *args)
    assert (code == 0) == expect_ok, stdout + stderr
    return SimpleNamespace(returncode=code, stdout=stdout, stderr=stderr)


def _hf_dir(tmp_path, name, **save_kwargs):
    model, _ = _hf_model(name)
    path = str(tmp_path / f"hf-{name}")
    model.save_pretrained(path, **save_kwargs)
    return model, path


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama3"])
@pytest.mark.slow  # pool cases; HF's representative: test_hf_interchange.py
def test_hf_to_ours_gives_the_hf_logits_at_tp_1_and_2_and_converts_back_exactly(pools, tmp_path, name):
    hf_model, hf_dir = _hf_dir(tmp_path, name)
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    out = _convert("--loader", "hf", "--saver", "megatron_fsdp", "--load-dir", hf_dir, "--save-dir", ckpt).stdout
    assert "model flags: --num-layers 2 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4" in out
    assert "--swiglu --normalization RMSNorm" in out and "--position-embedding-type rope" in out
    seq = 256 if name == "llama3" else 16
    ids = torch.randint(0, 100, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids).logits
    for tp in (1, 2):
        logits = pools(tp).run(converted_logits, ckpt, tp, ids, 100)[0]
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"TP={tp}: {m}")
    _convert("--loader", "megatron_fsdp", "--saver", "hf", "--load-dir", ckpt, "--save-dir", back)
    from safetensors.torch import load_file

    original, converted = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(
        os.path.join(back, "model.safetensors"))
    assert original.keys() == converted.keys()
    assert all(torch.equal(original[k], converted[k]) and original[k].dtype == converted[k].dtype for k in original)
    reloaded = getattr(transformers, type(hf_model).__name__).from_pretrained(back).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=0, rtol=0)


@pytest.mark.slow  # several conversions; HF's representative: test_hf_interchange.py
def test_sharded_hf_directories_both_ways_and_saver_dtype(tmp_path):
    hf_model, hf_dir = _hf_dir(tmp_path, "llama", max_shard_size="40KB")
    assert os.path.isfile(os.path.join(hf_dir, "model.safetensors.index.json"))
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    _convert("--loader", "hf", "--saver", "megatron_fsdp", "--load-dir", hf_dir, "--save-dir", ckpt,
             "--saver-dtype", "bf16")
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    _convert("--loader", "megatron_fsdp", "--saver", "hf", "--load-dir", ckpt, "--save-dir", back,
             "--max-shard-size", "30000", "--tokenizer-model", str(tokenizer))
    index = json.load(open(os.path.join(back, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert os.path.isfile(os.path.join(back, "tokenizer.json"))
    config = json.load(open(os.path.join(back, "config.json")))
    assert config["torch_dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]
    reloaded = transformers.LlamaForCausalLM.from_pretrained(back, torch_dtype=torch.float32)
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor.to(torch.bfloat16).float()), name


def test_bad_inputs_are_one_line_and_leave_nothing(tmp_path):
    _, hf_dir = _hf_dir(tmp_path, "llama", max_shard_size="40KB")
    target = tmp_path / "out"

    def refused(load_dir, match, *extra):
        proc = _convert("--loader", "hf", "--saver", "megatron_fsdp", "--load-dir", str(load_dir),
                        "--save-dir", str(target), *extra, expect_ok=False)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("convert.py: error:") and match in lines[0], proc.stderr
        assert not target.exists(), list(target.iterdir())

    empty = tmp_path / "empty"
    empty.mkdir()
    refused(empty, "has no config.json")
    shard = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))[-1]
    os.rename(os.path.join(hf_dir, shard), os.path.join(tmp_path, shard))
    refused(hf_dir, f"names {shard}, which")
    os.rename(os.path.join(tmp_path, shard), os.path.join(hf_dir, shard))
    config_path = os.path.join(hf_dir, "config.json")
    config = json.load(open(config_path))
    json.dump({**config, "architectures": ["GPT2LMHeadModel"]}, open(config_path, "w"))
    refused(hf_dir, "architectures ['GPT2LMHeadModel']: supported are LlamaForCausalLM")
    json.dump({**config, "intermediate_size": 80}, open(config_path, "w"))
    refused(hf_dir, "mlp.gate_proj.weight: [96, 64], the config says [80, 64]")
    json.dump(config, open(config_path, "w"))
    # A non-empty --save-dir of the HF saver is not overwritten.
    ckpt = tmp_path / "ckpt"
    _convert("--loader", "hf", "--saver", "megatron_fsdp", "--load-dir", hf_dir, "--save-dir", str(ckpt))
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    proc = _convert("--loader", "megatron_fsdp", "--saver", "hf", "--load-dir", str(ckpt), "--save-dir",
                    str(occupied), expect_ok=False)
    assert "is not an empty directory: not overwriting it" in proc.stderr
    assert os.listdir(occupied) == ["keep.txt"]


def _garbled(hf_dir, how):
    """`hf_dir` (one model.safetensors) spoiled as a download goes wrong: the file that is spoiled."""
    path = os.path.join(hf_dir, {"config not JSON": "config.json", "index not a map": "model.safetensors.index.json"}
                        .get(how, "model.safetensors"))
    if how == "index not a map":
        with open(path, "w") as f:
            json.dump({"weight_map": ["model.safetensors"]}, f)
    elif how == "a shape beyond any size":
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header, data = json.loads(f.read(size)), f.read()
        name = next(n for n in header if n != "__metadata__")
        header[name]["shape"] = [2 ** 62, 2 ** 62]
        encoded = json.dumps(header).encode()
        with open(path, "wb") as f:
            f.write(len(encoded).to_bytes(8, "little") + encoded + data)
    elif how == "random bytes":
        with open(path, "wb") as f:
            f.write(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                  dtype=torch.uint8).numpy().tobytes())
    elif how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    else:
        with open(path, "w") as f:
            f.write("<html>404 not found</html>")
    return path


@pytest.mark.parametrize("how, says", [
    ("random bytes", "not a safetensors file: its header would be"),
    ("truncated", "truncated: tensor "),
    ("config not JSON", "not JSON (Expecting value"),
    ("index not a map", "its weight_map is not an object of tensor names to file names"),
    ("a shape beyond any size", "tensor "),  # its shape and its bytes disagree
])
def test_a_broken_hugging_face_directory_is_one_line_naming_the_file_and_writes_nothing(tmp_path, how, says):
    _, hf_dir = _hf_dir(tmp_path, "llama")
    spoiled, target = _garbled(hf_dir, how), tmp_path / "out"
    for saver in ("megatron_fsdp", "mcore"):
        proc = _convert("--loader", "hf", "--saver", saver, "--load-dir", hf_dir, "--save-dir", str(target),
                        expect_ok=False)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"convert.py: error: {spoiled}: {says}"), proc.stderr
        if how == "a shape beyond any size":
            assert f"its shape [{2 ** 62}, {2 ** 62}] and dtype" in lines[0]
        assert not target.exists()


def test_a_write_that_fails_midway_leaves_no_save_dir(tmp_path, monkeypatch):
    """A tensor that cannot be read once the writing began (the disk, the network file system):
    DCP's failure, one line, and the --save-dir this run created is gone again."""
    from megatron_fsdp.dist_checkpointing import hf_directory

    _, hf_dir = _hf_dir(tmp_path, "llama")
    target = tmp_path / "out" / "ckpt"

    def failing(self, name):
        raise OSError(f"I/O error reading {name} (injected)")

    monkeypatch.setattr(hf_directory.SafetensorsFile, "tensor", failing)
    for saver in ("megatron_fsdp", "mcore"):
        proc = _convert("--loader", "hf", "--saver", saver, "--load-dir", hf_dir, "--save-dir", str(target),
                        expect_ok=False)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "I/O error reading" in lines[0], proc.stderr
        assert not (tmp_path / "out").exists()  # nor the parent it created


@pytest.mark.slow  # a pretrain() job in the worker pool
def test_finetune_from_converted_at_tp2_dp2_then_export_gives_our_logits_in_transformers(pools, tmp_path):
    """HF -> ours; pretrain_gpt.py --load --finetune --use-checkpoint-args at TP 2 x DP 2 (the
    model flags from the checkpoint, none on the command line) trains 2 steps and saves; that
    checkpoint exported -> transformers gives the logits of our model loaded from it. A tiny
    learning rate keeps the weights next to the original, so the export also gives the original
    model's logits: the fine-tuning started from the converted weights."""
    from pretrain_in_pool import pretrain_gpt_job

    hf_model, hf_dir = _hf_dir(tmp_path, "llama")
    converted, trained, exported = (str(tmp_path / n) for n in ("converted", "trained", "exported"))
    _convert("--loader", "hf", "--saver", "megatron_fsdp", "--load-dir", hf_dir, "--save-dir", converted)
    argv = ["--load", converted, "--finetune", "--use-checkpoint-args", "--use-torch-fsdp2",
            "--tensor-model-parallel-size", "2", "--seq-length", "16", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--lr", "1e-7", "--train-iters", "2", "--mock-data", "--vocab-size", "100",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0", "--num-workers", "0",
            "--log-interval", "1", "--save", trained, "--save-interval", "2"]
    outcomes = pools(4).run(pretrain_gpt_job, argv, timeout=400)
    out = "".join(text for _, text in outcomes)
    assert all(code == 0 for code, _ in outcomes), out[-3000:]
    assert "iteration        2/       2" in out, out[-3000:]
    _convert("--loader", "megatron_fsdp", "--saver", "hf", "--load-dir", trained, "--save-dir", exported)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(exported).eval()
    assert any(not torch.equal(reloaded.state_dict()[k], v) for k, v in hf_model.state_dict().items())
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = reloaded(ids).logits
        original = hf_model(ids).logits
    torch.testing.assert_close(got, pools(1).run(converted_logits, trained, 1, ids, 100)[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got, original, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # generate_gpt.py in the worker pool
def test_greedy_generation_from_a_converted_checkpoint_is_transformers(pools, tmp_path):
    """generate_gpt.py --load CONVERTED --use-checkpoint-args at TP 2 (the prompt as token ids,
    NullTokenizer) generates the tokens transformers' greedy generate() does. No --seq-length: the
    converted checkpoint stores one (its config's max_position_embeddings), as Megatron-LM's
    load_args_from_checkpoint takes it."""
    import re

    from pretrain_in_pool import generate_gpt_job

    hf_model, hf_dir = _hf_dir(tmp_path, "qwen2")
    converted = str(tmp_path / "converted")
    _convert("--loader", "hf", "--saver", "megatron_fsdp", "--load-dir", hf_dir, "--save-dir", converted)
    prompt = [5, 17, 42, 3, 99, 0]
    outcomes = pools(2).run(generate_gpt_job, [
        "--load", converted, "--use-checkpoint-args", "--tensor-model-parallel-size", "2",
        "--vocab-size", "100", "--prompts", " ".join(map(str, prompt)), "--num-tokens-to-generate", "10",
        "--greedy"], timeout=300)
    out = "".join(text for _, text in outcomes)
    assert all(code == 0 for code, _ in outcomes), out[-3000:]
    ours = [int(t) for t in re.search(r"> generated: '([\d ]*)'", out)[1].split()]
    with torch.no_grad():
        # An explicit mask: the prompt's last token is the pad id, which transformers would mask otherwise.
        ids = torch.tensor([prompt])
        theirs = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                                   pad_token_id=0)[0, len(prompt):].tolist()
    assert len(ours) == 10 and ours == theirs


@pytest.mark.e2e  # torchrun and two conversions, as a user runs them
def test_documented_hugging_face_commands_run_as_written(tmp_path):
    """The documented "From and to Hugging Face" commands (docs/checkpoints.md), as written, in a
    directory holding a tiny Llama as `llama-hf` (and the repository's tools/ and examples/): they
    succeed, and print neither a vocabulary-padding warning (a fine-tune has no saved run's loss
    to continue) nor a line per evaluation iteration."""
    import re

    with open(os.path.join(ROOT, "docs", "checkpoints.md")) as f:
        section = f.read().split("## From and to Hugging Face", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)[1]
    hf_model, _ = _hf_model("llama")
    hf_model.save_pretrained(str(tmp_path / "llama-hf"))
    for name in ("tools", "examples"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("model flags: --num-layers 2") == 2
    assert "--rope-scaling-factor" not in proc.stdout  # no rope scaling in this model: no factor either
    assert "padded vocabulary" not in proc.stdout, proc.stdout
    assert proc.stdout.count("Evaluating iter") <= 4, proc.stdout  # --eval-iters 2, validation and test
    reloaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "llama-ft-hf"))
    assert reloaded.state_dict().keys() == hf_model.state_dict().keys()


def test_use_checkpoint_args_fills_the_model_flags_and_names_what_is_wrong(tmp_path, capsys):
    """--use-checkpoint-args: the stored flags replace the command line's (said once) and stand in
    for the required ones; without --load, or with a directory holding no checkpoint, one line."""
    from megatron_fsdp.training.arguments import parse_args

    _, hf_dir = _hf_dir(tmp_path, "llama")
    ckpt = str(tmp_path / "ckpt")
    _convert("--loader", "hf", "--saver", "megatron_fsdp", "--load-dir", hf_dir, "--save-dir", ckpt)
    run = ["--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--mock-data",
           "--vocab-size", "100"]
    args = parse_args(["--load", ckpt, "--use-checkpoint-args", "--num-layers", "5", *run])
    assert (args.num_layers, args.hidden_size, args.num_query_groups, args.normalization, args.rotary_base) == (
        2, 64, 2, "RMSNorm", 50000)
    assert "--num-layers 2 from the checkpoint replaces 5" in capsys.readouterr().out
    for argv, said in ((["--use-checkpoint-args", *run], "--use-checkpoint-args needs --load"),
                       (["--use-checkpoint-args", "--load", str(tmp_path), *run],
                        "--use-checkpoint-args: no checkpoint in")):
        with pytest.raises(SystemExit) as stop:
            parse_args(argv)
        assert stop.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], lines
