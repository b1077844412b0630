"""A small PyTorch GPT (the C++ demo's shapes: byte vocabulary, 4 layers, width 128, 4 heads, context 64)
trained on Debian's fortunes with torch.optim.AdamW or dmuon.torch.DMuon, on gloo (CPU), data
parallel under DDP (the default), FSDP2 (--fsdp2: fully_shard per block and at the root, on a 1-D
mesh of every rank) or HSDP (--hsdp R,S: fully_shard on a 2-D (replicate, shard) mesh of R replicas
of S shards each; --hsdp alone is 2 replicas of W/2 shards); --owner-held: DMuon's owner-centric mode.
--device cuda: each rank on its own GPU (the node's LOCAL_RANK-th) with NCCL between ranks, the model, its
batches and the optimizer's state on it (dmuon.torch then runs Newton-Schulz through libdmuon_c's CUDA backend).

    torchrun --standalone --nproc_per_node 2 examples/torch_train.py --optim dmuon --fsdp2
    torchrun --standalone --nproc_per_node 1 examples/torch_train.py --optim dmuon --device cuda [--owner-held]
    mpirun --allow-run-as-root -np 2 python examples/torch_train.py --optim dmuon   (also works)
    PYTHONPATH=build/python when running from the build tree.

The only line that differs between the two optimizers is the one that builds it (make_optimizer),
from model.named_parameters() in every mode. Every rank draws the same global batch of sequences
(seeded by step) and trains on its slice; DDP and FSDP2 average the gradients over all ranks, so the
update is the one of the global batch.

--csv FILE writes `dmuon train --csv`'s metrics file (read by `dmuon compare`, as `make demo` does):
per step the training loss, the validation loss every --val-every steps (the mean over --val-batches
fixed batches of the held-out last tenth of the corpus), and the slowest rank's step time, its exposed
communication (the time it was blocked on torch.distributed's collectives: a synchronous call, an
asynchronous one's wait(); tests/python/collective_ledger.py) and, as `dmuon train`'s, its
forward+backward and optimizer times without those waits.
"""

import argparse
import contextlib
import math
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


CONTEXT = 64


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(width, 3 * width), "proj": nn.Linear(width, width)})
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.ModuleDict({"fc": nn.Linear(width, 4 * width), "proj": nn.Linear(4 * width, width)})

    def forward(self, x):  # x is (B, T, C)
        B, T, C = x.shape
        q, k, v = self.attn["qkv"](self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, NH, T, hs)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.heads)  # (B, NH, T, T)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn["proj"](y)
        return x + self.mlp["proj"](F.gelu(self.mlp["fc"](self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    """Parameter names as the C++ GPT's: wte, wpe, blocks.<l>.{ln1,attn.qkv,attn.proj,ln2,mlp.fc,mlp.proj}, ln_f, head."""

    def __init__(self, vocab=256, context=64, layers=4, width=128, heads=4):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2 initialisation
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets):  # idx, targets are (B, T) bytes
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class StepMetrics:
    """Per-step times of this rank (forward+backward and optimizer, each less its time blocked on
    collectives, and that time), their maximum over the ranks written by rank 0 (path given) as
    `dmuon train --csv`'s rows."""

    HEADER = "step,train_loss,val_loss,step_s,fwd_bwd_s,optim_s,comm_wait_s"

    def __init__(self, path):
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
        import collective_ledger
        self.ledger = collective_ledger.Ledger()
        self._recording = collective_ledger.recording(self.ledger)
        self._recording.__enter__()
        self.times = {}
        self.file = open(path, "w") if path else None
        if self.file:
            print(self.HEADER, file=self.file, flush=True)

    @contextlib.contextmanager
    def timing(self, part):
        self.ledger.label = part
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[part] = time.perf_counter() - t0
            self.ledger.label = None

    def write(self, step, train_loss, val_loss):
        """The slowest rank's times of this step (one small all_reduce), written by rank 0. As `dmuon
        train`'s, forward+backward and optimizer times leave out the waits, so on each rank the three parts
        add up to its step."""
        wait = {part: self.ledger.blocked(part) for part in ("fwd_bwd", "optim")}
        fwd_bwd, optim = (self.times[part] - wait[part] for part in ("fwd_bwd", "optim"))
        t = torch.tensor([sum(self.times.values()), fwd_bwd, optim, sum(wait.values())], dtype=torch.float64)
        self.ledger.records.clear()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if self.file:
            val = "" if val_loss is None else f"{val_loss:.9g}"
            print(f"{step},{train_loss:.9g},{val}," + ",".join(f"{x:.9g}" for x in t.tolist()),
                  file=self.file, flush=True)

    def close(self):
        self._recording.__exit__(None, None, None)
        if self.file:
            self.file.close()


def load_corpus(folder):
    """Bytes of every plain file of the folder in name order (no symlinks, subfolders or NAME.dat indexes)."""
    folder = pathlib.Path(folder)
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink() and not p.name.startswith("."))
    names = {p.name for p in files}
    text = b"".join(p.read_bytes() for p in files if not (p.suffix == ".dat" and p.stem in names))
    if len(text) < 10_000:
        raise SystemExit(f"torch_train: corpus {folder} has only {len(text)} bytes (install Debian's fortunes)")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def setup_device(name, environ=os.environ):
    """(process group backend, torch.device) for --device: gloo on the CPU, or NCCL on this rank's own GPU,
    the node's local rank-th (LOCAL_RANK from torchrun, OMPI_COMM_WORLD_LOCAL_RANK from mpirun), made current."""
    if name == "cpu":
        return "gloo", torch.device("cpu")
    local = int(environ.get("LOCAL_RANK", environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))
    if not torch.cuda.is_available():
        raise SystemExit("torch_train: --device cuda needs a GPU, and torch sees none")
    if local >= torch.cuda.device_count():
        raise SystemExit(f"torch_train: local rank {local} has no GPU of its own ({torch.cuda.device_count()} "
                         "on this node): start at most one rank per GPU")
    torch.cuda.set_device(local)
    return "nccl", torch.device("cuda", local)


def parallelize(model, mode, world, owner_held, device=torch.device("cpu")):
    """The model, on `device`, under DDP, FSDP2 (mode "fsdp2") or HSDP (mode (R, S)): each block, then the
    root, wrapped with fully_shard, whose parameters become DTensors sharded on dim 0 over the mesh. With
    owner_held, DMuon's matrices are first held whole on their owners (dmuon.torch.hold_on_owners)
    and kept out of DDP and FSDP2."""
    model = model.to(device)
    mesh = None
    if mode == "fsdp2":
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    elif mode != "ddp":
        mesh = init_device_mesh(device.type, mode, mesh_dim_names=("replicate", "shard"))
    ignored = None
    if owner_held:
        import dmuon.torch
        ignored = dmuon.torch.hold_on_owners(model, mesh).params
    if mode == "ddp":
        if world == 1:
            return model
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ignored)
    return fully_shard(model, mesh=mesh, ignored_params=ignored)


def hsdp_mesh_shape(spec, world):
    """(replicas, shards) from --hsdp's value ("auto" or "R,S"), checked against the world size."""
    if spec == "auto":
        if world % 2:
            raise SystemExit(f"torch_train: --hsdp needs an even number of ranks for 2 replicas, got {world}; "
                             "give --hsdp R,S with R*S = the world size")
        return 2, world // 2
    try:
        replicas, shards = (int(v) for v in spec.split(","))
    except ValueError:
        raise SystemExit(f"torch_train: --hsdp {spec}: expected R,S (two integers)") from None
    if replicas < 1 or shards < 1 or replicas * shards != world:
        raise SystemExit(f"torch_train: --hsdp {spec}: {replicas} replicas x {shards} shards is not the "
                         f"world size {world}")
    return replicas, shards


def cosine_schedule(warmup, steps, floor=0.1):
    """The multiplier of `dmuon train`'s schedule at each step: linear warmup over `warmup` steps,
    then a cosine decay to `floor` times the peak at the last step."""
    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - 1 - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def make_optimizer(args, model):
    if args.optim == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.adamw_lr, betas=(0.9, 0.95), weight_decay=0.0)
    import dmuon.torch
    return dmuon.torch.DMuon(model.named_parameters(), lr=args.lr, adamw_lr=args.adamw_lr)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optim", choices=["adamw", "dmuon"], default="dmuon")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64, help="sequences per step, all ranks together")
    parser.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    parser.add_argument("--adamw-lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--corpus", default="/usr/share/games/fortunes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one GPU per rank (the node's local rank-th), NCCL between ranks")
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument("--fsdp2", action="store_true", help="FSDP2 (fully_shard) on a 1-D mesh instead of DDP")
    layout.add_argument("--hsdp", nargs="?", const="auto", metavar="R,S",
                        help="HSDP: FSDP2 on a 2-D (replicate, shard) mesh of R replicas x S shards "
                             "(default 2 x world/2)")
    parser.add_argument("--owner-held", action="store_true",
                        help="DMuon's owner-centric mode: Muon matrices held whole on their owners, moved by hooks")
    parser.add_argument("--warmup", type=int, default=None,
                        help="linear warmup over this many steps, then cosine decay to 0.1x (default: constant lr)")
    parser.add_argument("--csv", default=None, help="write per-step metrics here (dmuon train --csv's format)")
    parser.add_argument("--val-every", type=int, default=50, help="validation loss every N steps (with --csv)")
    parser.add_argument("--val-batches", type=int, default=8, help="batches of --batch sequences per validation")
    parser.add_argument("--check-loss-falls", action="store_true",
                        help="exit 1 unless the mean loss of the last 5 steps is below that of the first 5")
    args = parser.parse_args()

    from dmuon.torch.mpirun import init_process_group
    backend, device = setup_device(args.device)
    rank, world = init_process_group(backend)
    if args.batch % world:
        raise SystemExit(f"torch_train: --batch {args.batch} is not divisible by {world} ranks")
    mode = hsdp_mesh_shape(args.hsdp, world) if args.hsdp else "fsdp2" if args.fsdp2 else "ddp"
    if args.owner_held and args.optim != "dmuon":
        raise SystemExit("torch_train: --owner-held is DMuon's mode (--optim dmuon)")
    torch.manual_seed(args.seed)
    model = parallelize(Gpt(), mode, world, args.owner_held, device)
    optimizer = make_optimizer(args, model)
    schedule = None
    if args.warmup is not None:
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(args.warmup, args.steps))

    data = load_corpus(args.corpus)
    split = len(data) - len(data) // 10

    def batch(seed, low, high):  # this rank's slice of a global batch of --batch sequences from data[low:high]
        offsets = torch.randint(low, high - CONTEXT - 1, (args.batch,), generator=torch.Generator().manual_seed(seed))
        mine = offsets[rank * (args.batch // world):(rank + 1) * (args.batch // world)]
        return torch.stack([data[o:o + CONTEXT + 1] for o in mine.tolist()]).to(device)  # (B/W, T+1)

    metrics = StepMetrics(args.csv if rank == 0 else None) if args.csv else None
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        rows = batch(args.seed * 1_000_003 + step, 0, split)
        with metrics.timing("fwd_bwd") if metrics else contextlib.nullcontext():
            loss = model(rows[:, :-1], rows[:, 1:])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        with metrics.timing("optim") if metrics else contextlib.nullcontext():
            optimizer.step()
        if schedule is not None:
            schedule.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        if metrics:
            val = None
            if step % args.val_every == 0 or step == args.steps - 1:
                with torch.no_grad():
                    val = torch.stack([model(r[:, :-1], r[:, 1:]) for r in
                                       (batch(10**9 + i, split, len(data)) for i in range(args.val_batches))]).mean()
                dist.all_reduce(val)
                val = float(val) / world
            metrics.write(step, losses[-1], val)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {time.perf_counter() - start:.1f} s", flush=True)
    first, last = sum(losses[:5]) / len(losses[:5]), sum(losses[-5:]) / len(losses[-5:])
    if rank == 0:
        where = "x".join(map(str, mode)) + " HSDP" if isinstance(mode, tuple) else mode.upper()
        where += ", owner-held" if args.owner_held else ""
        print(f"{args.optim}, {where}: {world} ranks on {args.device}, {args.steps} steps, "
              f"loss {first:.4f} (first 5) -> {last:.4f} (last 5)")
    # The model goes before the process group. A DDP model's Reducer (C++) holds a reference to the
    # group; were it the last one, dropping the model would join gloo's worker threads while holding
    # the GIL, and a worker still freeing a tensor that Python let go of waits for the GIL: a deadlock
    # (torch 1.13 and 2.11). Freed last through its Python object, the group is destroyed without the GIL.
    if metrics:
        metrics.close()
    del optimizer, model
    dist.destroy_process_group()
    if args.check_loss_falls and not last < first:
        print(f"torch_train: the loss did not fall ({first:.4f} -> {last:.4f})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
