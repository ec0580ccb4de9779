"""Models that are not ours, their data and the single-process reference, for the tests of
NVIDIA Megatron-FSDP's `fully_shard` API (tests/test_fully_shard*.py)."""

import torch
import torch.distributed as dist
from torch import nn

import megatron_fsdp
from megatron_fsdp import fully_shard, fully_shard_model

STEPS = 3


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class EncoderStack(nn.Module):
    def __init__(self, layers=3, width=16):
        super().__init__()
        self.inp = nn.Linear(6, width)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(width, 2, dim_feedforward=32, dropout=0.0,
                                                               batch_first=True) for _ in range(layers))
        self.out = nn.Linear(width, 5)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h.mean(1))


MODELS = {  # name: (build, units (classes or import paths), input of n samples)
    "cnn": (SmallCNN, [nn.Sequential], lambda g, n: torch.randn(n, 3, 6, 6, generator=g)),
    "encoder": (EncoderStack, ["torch.nn.TransformerEncoderLayer"], lambda g, n: torch.randn(n, 4, 6, generator=g)),
}


def batch(model_name, step, rank, n=4):
    """Rank `rank`'s inputs and labels of step `step` (the reference concatenates every rank's)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return MODELS[model_name][2](g, n), torch.randint(0, 5, (n,), generator=g)


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def gathered(param):
    """The full tensor of a sharded parameter (DTensor), or the tensor itself."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def one_process_reference(model_name, world, microbatches=1):
    """The parameters after STEPS steps of one process with SGD and momentum on every rank's batch."""
    torch.manual_seed(0)
    model = MODELS[model_name][0]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        for mb in range(microbatches):
            batches = [batch(model_name, step * microbatches + mb, r) for r in range(world)]
            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach() for name, p in model.named_parameters()}


class TwoLayerMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(2))
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def train_like_one_process(model_name, strategy, **kwargs):
    """Runs in every worker: `fully_shard` the model with SGD and momentum (`kwargs` are
    fully_shard's), train STEPS steps on this rank's data, and assert that the full parameters
    equal the one-process reference on every rank's data. Returns the model and optimizer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    build, units, _ = MODELS[model_name]
    module = build()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    model, opt = fully_shard(module, opt, fsdp_unit_modules=units, zero_dp_strategy=strategy, **kwargs)
    assert isinstance(model, megatron_fsdp.MegatronFSDP) and model.module is module
    for step in range(STEPS):
        x, y = batch(model_name, step, rank)
        loss_of(model, x, y).backward()
        model.finish_grad_sync()
        opt.step()
        opt.zero_grad()
    assert_like_one_process(model, model_name, world)
    return model, opt


def assert_like_one_process(model, model_name, world, microbatches=1):
    """Every full parameter of the sharded `model` equals one_process_reference's (1e-5)."""
    expected = one_process_reference(model_name, world, microbatches)
    got = {name: gathered(p).detach() for name, p in model.module.named_parameters()}
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


def adam_run(path, steps, *, resume_from=None, seed=0, precreated=True, **kwargs):
    """Runs in every worker: Adam on the encoder stack, through `fully_shard` (ZeRO-3; `kwargs`
    are fully_shard's); optionally restored from `resume_from` first (DCP, in place, NVIDIA's
    way) and saved to `path` at the end. Returns the full parameters."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    torch.manual_seed(seed)
    module = EncoderStack()
    if precreated:
        opt = torch.optim.Adam(module.parameters(), lr=1e-2)
        model, opt = fully_shard(module, opt, fsdp_unit_modules=[nn.TransformerEncoderLayer], **kwargs)
    else:  # built on the sharded parameters: its state appears in its first step
        model = fully_shard_model(module, fsdp_unit_modules=[nn.TransformerEncoderLayer], **kwargs)
        opt = torch.optim.Adam(model.module.parameters(), lr=1e-2)
    first = 0
    if resume_from is not None:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        dcp.load(state, checkpoint_id=resume_from)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        first = int(opt.state_dict()["state"][0]["step"])
    for step in range(first, steps):
        x, y = batch("encoder", step, rank)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    if path is not None:
        dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=path)
    return [gathered(p).detach().clone() for p in model.module.parameters()]
