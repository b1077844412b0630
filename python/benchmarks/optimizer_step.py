"""One optimizer step on a real model's shapes (default: qwen2.5-0.5b, first 4 layers) as torch tensors,
side by side in one run (numbers for notes, not a test):

  adamw            torch.optim.AdamW on every parameter
  reference-muon   the common public torch Muon (KellerJordan/Muon's DDP design, DESIGN 2.1 and 7):
                   plain quintic Newton–Schulz in torch ops, parameters sorted by size and dealt
                   round-robin to owners, the updated parameters all-gathered; AdamW for the rest
  dmuon            dmuon.torch.DMuon on replicated parameters (the DDP case)
  dmuon-sharded    dmuon.torch.DMuon on dim-0 shards (the FSDP2 case; AdamW then runs on shards too)

    mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 .venv/bin/python \\
        python/benchmarks/optimizer_step.py [--autotune] [--json]

Gradients are seeded random values, identical on every rank (as after DDP's all-reduce). A step's
time is the slowest rank's (barrier before, all_reduce MAX after); the table shows the median over
--steps timed steps after one warm-up step. The Muon rows start from the same weights and must end
with nearly the same weight norm (same math; DMuon's Gram path rounds differently).
"""

import argparse
import json
import math
import pathlib
import statistics
import sys
import time

import torch
import torch.distributed as dist

import dmuon
import dmuon.torch
from dmuon.torch import DMuon, Sharded, chunk_rows
from dmuon.torch.mpirun import init_process_group_from_mpirun
from dmuon.torch.torch_engine import newton_schulz

REPO = pathlib.Path(__file__).resolve().parents[2]


def zeropower_via_newtonschulz5(g, steps=5, dtype=torch.float32):
    """The public reference: the plain quintic recurrence in torch ops (DESIGN 2.1; dmuon.torch's torch engine, its
    standard recurrence); float32 on the CPU (bf16 matmuls are slow there), bf16 on GPUs as KellerJordan/Muon."""
    return newton_schulz(g, "keller", steps, "standard", dtype)


class ReferenceMuon(torch.optim.Optimizer):
    """KellerJordan/Muon's DDP Muon: same-shape parameters in groups, dealt round-robin (largest first);
    each rank updates its own and all_gathers the parameters. Scale as DMuon's match_rms_adamw."""

    def __init__(self, params, lr=0.02, momentum=0.95, ns_dtype=torch.float32):
        # by shape rather than KellerJordan's numel: gloo's all_gather needs equal shapes
        shapes = sorted({tuple(p.shape) for p in params}, key=lambda s: (-math.prod(s), s))
        groups = [dict(params=[p for p in params if tuple(p.shape) == shape]) for shape in shapes]
        super().__init__(groups, dict(lr=lr, momentum=momentum))
        self.ns_dtype = ns_dtype
        self.world, self.rank = dist.get_world_size(), dist.get_rank()

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            params = group["params"]
            # .data: gloo copies into the outputs on its own thread, where grad mode is on
            padded = [p.data for p in params] + [torch.empty_like(params[-1].data)] * (-len(params) % self.world)
            for base in range(0, len(params), self.world):
                if base + self.rank < len(params):
                    p = params[base + self.rank]
                    st = self.state[p]
                    buf = st.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.lerp_(p.grad, 1 - group["momentum"])
                    u = p.grad.lerp(buf, group["momentum"])
                    o = zeropower_via_newtonschulz5(u.view(u.shape[0], -1), dtype=self.ns_dtype).view_as(p)
                    p.add_(o, alpha=-group["lr"] * 0.2 * max(p.shape[0], p[0].numel()) ** 0.5)
                if self.world > 1:
                    dist.all_gather(padded[base:base + self.world], padded[base + self.rank])


class Combined:
    """Reference Muon for the hidden matrices + torch.optim.AdamW for the rest (MuonWithAuxAdam)."""

    def __init__(self, muon, adamw):
        self.optimizers = [muon, adamw]

    def step(self):
        for o in self.optimizers:
            o.step()


def model_params(manifest, layers):
    specs = dmuon.model_params(manifest, layers)
    return [(p["name"], tuple(p["shape"]), p["role"] == "matrix") for p in specs]


def make_tensors(specs, rank, world, sharded):
    """(named parameters with seeded values and gradients, the same on every rank; dim-0 shards if sharded)."""
    named = []
    for k, (name, shape, _) in enumerate(specs):
        gen = torch.Generator().manual_seed(k)
        full = torch.randn(shape, generator=gen) * 0.02
        grad = torch.randn(shape, generator=gen) * 1e-3
        if sharded:
            start, count = chunk_rows(shape[0], world)[rank]
            p = torch.nn.Parameter(full[start:start + count].clone())
            p.grad = grad[start:start + count].clone()
            named.append((name, Sharded(p, shape)))
        else:
            p = torch.nn.Parameter(full)
            p.grad = grad
            named.append((name, p))
    return named


def weight_norm(named, sharded):
    sq = torch.zeros(1, dtype=torch.float64)
    for _, p in named:
        t = p.local if isinstance(p, Sharded) else p
        sq += t.detach().double().pow(2).sum()
    if sharded:
        dist.all_reduce(sq)
    return math.sqrt(float(sq))


def time_steps(opt, steps):
    times = []
    for i in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i > 0:  # the first step allocates state
            times.append(float(elapsed))
    return statistics.median(times)


def run_variant(kind, specs, rank, world, steps):
    sharded = kind == "dmuon-sharded"
    named = make_tensors(specs, rank, world, sharded)
    matrix = {name for name, _, is_matrix in specs if is_matrix}
    ns_ms = None
    if kind == "adamw":
        opt = torch.optim.AdamW([p for _, p in named], lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
    elif kind == "reference-muon":
        opt = Combined(ReferenceMuon([p for n, p in named if n in matrix]),
                       torch.optim.AdamW([p for n, p in named if n not in matrix], lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0))
    else:
        opt = DMuon([{"params": [(n, p) for n, p in named if n in matrix], "use_muon": True},
                     {"params": [(n, p) for n, p in named if n not in matrix], "use_muon": False}])
    step_s = time_steps(opt, steps)
    if kind.startswith("dmuon"):
        ns = torch.tensor([opt.last_stats["ns_s"]], dtype=torch.float64)
        dist.all_reduce(ns, op=dist.ReduceOp.MAX)
        ns_ms = 1e3 * float(ns)
    norm = weight_norm(named, sharded)
    del opt, named
    return {"optimizer": kind, "step_ms": 1e3 * step_s, "ns_ms_max_rank": ns_ms, "weight_norm": norm}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "qwen2.5-0.5b.json"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per optimizer (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch and BLAS threads per rank")
    parser.add_argument("--optimizers", default="adamw,reference-muon,dmuon,dmuon-sharded")
    parser.add_argument("--autotune", action="store_true",
                        help="rank 0 first tunes DMuon's shapes into the default tuning cache (alone; minutes). "
                        "Not --tune: mpirun takes --tune anywhere on its command line")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()

    # the other ranks wait in a barrier while rank 0 tunes
    rank, world = init_process_group_from_mpirun("gloo", timeout_s=3600 if args.autotune else 120)
    torch.set_num_threads(args.threads)
    specs = model_params(args.model, args.layers)
    if args.autotune:
        counts = {}
        for _, shape, is_matrix in specs:
            if is_matrix:
                key = (shape[0], math.prod(shape[1:]))
                counts[key] = counts.get(key, 0) + 1
        if rank == 0:
            dmuon.tune([(r, c, -(-n // world)) for (r, c), n in sorted(counts.items())], threads=args.threads)
        dist.barrier()
    rows = [run_variant(kind, specs, rank, world, args.steps) for kind in args.optimizers.split(",")]
    by_name = {r["optimizer"]: r for r in rows}
    for r in rows:
        if "adamw" in by_name:
            r["vs_adamw"] = r["step_ms"] / by_name["adamw"]["step_ms"]
        if "reference-muon" in by_name:
            r["speedup_over_reference_muon"] = by_name["reference-muon"]["step_ms"] / r["step_ms"]
    if rank == 0:
        numel = sum(math.prod(s) for _, s, _ in specs)
        context = {"model": pathlib.Path(args.model).stem, "layers": args.layers, "parameters": numel,
                   "matrices": sum(1 for s in specs if s[2]), "ranks": world, "threads_per_rank": args.threads,
                   "torch": torch.__version__, "timed_steps": args.steps, "tuned": args.autotune}
        if args.json:
            print(json.dumps({"context": context, "results": rows}, indent=1))
        else:
            print(f"optimizer step: {context['model']} (--layers {args.layers}: {numel / 1e6:.1f}M parameters, "
                  f"{context['matrices']} Muon matrices), {world} ranks x {args.threads} thread(s), torch {torch.__version__}")
            print("| optimizer | step ms | NS ms (slowest rank) | vs AdamW | speedup over reference Muon | weight norm |")
            print("|---|---|---|---|---|---|")
            for r in rows:
                ns = f"{r['ns_ms_max_rank']:.1f}" if r["ns_ms_max_rank"] is not None else ""
                ratios = [f"{r[k]:.2f}x" if k in r else "" for k in ("vs_adamw", "speedup_over_reference_muon")]
                print(f"| {r['optimizer']} | {r['step_ms']:.1f} | {ns} | {ratios[0]} | {ratios[1]} | "
                      f"{r['weight_norm']:.6f} |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
