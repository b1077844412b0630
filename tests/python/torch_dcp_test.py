"""DMuon's state through torch.distributed.checkpoint (DCP) under real FSDP2, at world sizes that change.

One script, two roles, each a separate torchrun (or mpirun) launch on gloo:

  torch_dcp_test.py save DIR   (at N ranks, e.g. 2)
      trains a fully_shard model 5 steps, saves model + optimizer into DIR/step5 with
      get_state_dict + dcp.save, trains on to step 10 (the uninterrupted run, whose full weights go
      to DIR/final.pt), then loads DIR/step5 into a fresh model and optimizer at the same N and
      checks the resumed steps 6..10 are bit-identical to the uninterrupted ones. It also checks that
      get_state_dict on a fresh DMuon changes no parameter and counts no update (DCP initialises an
      optimizer without state by a step with zero gradients and lr 0; DMuon's state exists from
      construction, so that step never runs), and measures each rank's peak memory while saving the
      optimizer state of a larger model built on the meta device: it must stay below the whole
      optimizer state's bytes (a rank that gathered the state would need all of them).
  torch_dcp_test.py load DIR   (at M ranks, e.g. 3 or 1, after a save at another N)
      loads DIR/step5 into a fresh model and optimizer at M ranks (DCP reshards every DTensor),
      trains steps 6..10 and checks every weight is within 1e-5 (relative Frobenius, the float64
      reference tolerance of the other tests: only the order of float32 sums differs) of DIR/final.pt.

With a third argument `hsdp` the role runs on a (2, N/2) HSDP mesh instead (N even), so a
checkpoint saved under HSDP can be loaded under FSDP2 at another size, and the other way round.

The model: an embedding and a head (AdamW), two blocks of norm (AdamW), up (70 rows: divisible by
neither 3 nor 4), down, a (5, 40, 40) expert stack (5 experts: 3+2 at 2 ranks, 2+2+1 at 3, an empty
shard at 4) and a 2-row gate (fewer rows than ranks at 3), each block and the root fully_shard. Every rank sees the same batch, so the gradient does not depend on the world size.
"""

import os
import resource
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dcp_io import load, save
from dmuon.torch import DMuon
from dmuon.torch.mpirun import init_process_group
from rank_exit import exit_rank
from rank_checks import check, finish

VOCAB, DIM, HIDDEN, EXPERTS, GATE = 64, 40, 70, 5, 2
SAVED_AT, STEPS = 5, 10
TOLERANCE = 1e-5

class Block(torch.nn.Module):
    def __init__(self, dim, hidden, experts):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(experts, dim, dim) / dim ** 0.5)  # (E, dim, dim)
        self.gate = torch.nn.Linear(dim, GATE, bias=False)

    def forward(self, x):                                   # x (B, T, dim)
        h = self.norm(x)
        mixed = torch.einsum("btd,edf->btf", h, self.experts) / self.experts.shape[0]
        return x + self.down(torch.relu(self.up(h))) + mixed + self.gate(h).sum(-1, keepdim=True)


class Net(torch.nn.Module):
    def __init__(self, vocab=VOCAB, dim=DIM, hidden=HIDDEN, experts=EXPERTS):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList([Block(dim, hidden, experts) for _ in range(2)])
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):                              # tokens (B, T) → logits (B, T, vocab)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sharded_net(seed, **sizes):
    torch.manual_seed(seed)
    model = Net(**sizes)
    mesh = {}
    if HSDP:
        mesh["mesh"] = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, **mesh)
    fully_shard(model, **mesh)
    return model


def make_optimizer(model):
    # float32 Newton–Schulz (not the machine's default, bf16 on a CPU with bf16 matrix units): the check is float32's
    return DMuon(model.named_parameters(), lr=0.02, adamw_lr=3e-3, weight_decay=0.01, clip_grad_norm=5.0,
                 ns_dtype="float32")


def train(model, opt, steps):
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, VOCAB, (4, 9), generator=gen)   # the same batch on every rank
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()


def local_values(model, opt):
    """{name: this rank's parameter shard} and {(index, key): this rank's state tensor}."""
    params = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    state = {(i, k): (v.to_local() if hasattr(v, "to_local") else v).clone()
             for i, entry in opt.state_dict()["state"].items() for k, v in entry.items()}
    return params, state


def full_weights(model):
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def check_fresh_get_state_dict_is_harmless():
    model = sharded_net(seed=1)
    opt = make_optimizer(model)
    before = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    get_state_dict(model, opt)
    for n, p in model.named_parameters():
        check(torch.equal(p.detach().to_local(), before[n]), f"get_state_dict on a fresh DMuon changed {n}")
        check(p.grad is None, f"get_state_dict on a fresh DMuon left a gradient on {n}")
    check(opt.updates == 0, f"get_state_dict on a fresh DMuon counted {opt.updates} updates")


def state_bytes(opt):
    """(bytes of the whole optimizer state, of this rank's part)."""
    whole = mine = 0
    for entry in opt.state.values():
        for v in entry.values():
            local = v.to_local() if hasattr(v, "to_local") else v
            whole += v.numel() * v.element_size()
            mine += local.numel() * local.element_size()
    return whole, mine


def check_save_memory(folder):
    """Peak RSS growth while dcp.save writes the optimizer state of a model built on the meta
    device (no rank ever holds a full parameter), against the whole state's bytes. The growth is
    bounded above by the peak after the save minus the resident size before it."""
    with torch.device("meta"):
        model = Net(vocab=4096, dim=512, hidden=1000, experts=4)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    opt = make_optimizer(model)
    with torch.no_grad():
        for entry in opt.state.values():  # touch every page, as a trained state would
            for v in entry.values():
                (v.to_local() if hasattr(v, "to_local") else v).normal_()
    _, optim_sd = get_state_dict(model, opt)
    whole, mine = state_bytes(opt)
    before = rss_bytes()
    peak_before = peak_rss_bytes()
    dist.barrier()
    dcp.save({"optim": optim_sd}, checkpoint_id=folder)
    peak = peak_rss_bytes()
    growth = max(0, peak - before)
    print(f"rank {RANK}: dcp.save of the optimizer state: whole state {whole / 2**20:.1f} MiB, this rank's "
          f"{mine / 2**20:.1f} MiB; RSS before {before / 2**20:.1f} MiB (peak so far {peak_before / 2**20:.1f}), "
          f"peak after {peak / 2**20:.1f}: growth at most {growth / 2**20:.1f} MiB", flush=True)
    check(growth < whole, f"saving grew this rank's memory by {growth} bytes, not below the whole state's {whole}")


def rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def peak_rss_bytes():
    """The process's peak resident size so far (Linux's VmHWM, as getrusage's ru_maxrss)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def role_save(folder):
    check_save_memory(os.path.join(folder, "memory"))  # first: no earlier peak may hide the save's
    check_fresh_get_state_dict_is_harmless()
    model = sharded_net(seed=0)
    opt = make_optimizer(model)
    train(model, opt, range(SAVED_AT))
    save(model, opt, os.path.join(folder, "step5"))
    train(model, opt, range(SAVED_AT, STEPS))
    straight_params, straight_state = local_values(model, opt)
    final = full_weights(model)
    if RANK == 0:
        torch.save(final, os.path.join(folder, "final.pt"))

    resumed = sharded_net(seed=1)
    opt2 = make_optimizer(resumed)
    load(resumed, opt2, os.path.join(folder, "step5"))
    check(opt2.updates == SAVED_AT, f"same size: {opt2.updates} updates after loading, expected {SAVED_AT}")
    train(resumed, opt2, range(SAVED_AT, STEPS))
    params, state = local_values(resumed, opt2)
    for n, v in straight_params.items():
        check(torch.equal(params[n], v), f"same size: {n} not bit-identical after the resumed steps")
    for k, v in straight_state.items():
        check(torch.equal(state[k], v), f"same size: optimizer state {k} not bit-identical")
    return f"saved at {WORLD} ranks, same-size resume bit-identical"


def role_load(folder):
    model = sharded_net(seed=1)
    opt = make_optimizer(model)
    load(model, opt, os.path.join(folder, "step5"))
    check(opt.updates == SAVED_AT, f"{opt.updates} updates after loading, expected {SAVED_AT}")
    train(model, opt, range(SAVED_AT, STEPS))
    expected = torch.load(os.path.join(folder, "final.pt"))
    worst = 0.0
    for n, w in full_weights(model).items():
        err = float((w.double() - expected[n].double()).norm() / expected[n].double().norm())
        worst = max(worst, err)
        check(err <= TOLERANCE, f"{n}: relative difference {err:.2e} to the uninterrupted run > {TOLERANCE:.0e}")
    return f"loaded at {WORLD} ranks, worst relative difference to the uninterrupted run {worst:.1e}"


def main(role, folder):
    summary = {"save": role_save, "load": role_load}[role](folder)
    return finish(f"torch_dcp_test {role} np {WORLD}: {summary}")


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] not in ("save", "load") or sys.argv[3:] not in ([], ["hsdp"]):
        sys.exit(f"usage: {sys.argv[0]} save|load FOLDER [hsdp]")
    RANK, WORLD = init_process_group("gloo")
    HSDP = sys.argv[3:] == ["hsdp"]
    if HSDP and WORLD % 2:
        sys.exit(f"{sys.argv[0]}: hsdp needs an even number of ranks, not {WORLD}")
    exit_rank(main(sys.argv[1], sys.argv[2]))
