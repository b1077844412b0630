"""Training steps under FSDP2 (CPU, gloo) side by side in one run, for notes (not a test):

  adamw            torch.optim.AdamW on every parameter (the baseline)
  torch-muon       torch.optim.Muon the way FSDP2 users use it today: all-gather each Muon matrix's
                   full gradient, run Muon on a full copy on every rank, keep this rank's rows;
                   AdamW for the rest
  muon-fsdp2       the muon-fsdp2 package from PyPI (gathers each gradient on one rank, scatters the
                   orthogonalized rows back; needs rows divisible by the ranks), when importable
  dion-muon        microsoft/dion's Muon on FSDP2's shards (all-to-all of same-shape batches), when
                   importable
  dion-muon-f32    the same, given a float32 Newton–Schulz (Keller's quintic, dmuon's 5 steps) as its
                   newton_schulz_func: dion's design without bfloat16 arithmetic (its all-to-alls still
                   carry bfloat16)
  dmuon-a2a        dmuon.torch.DMuon on FSDP2's shards (the all-to-all mode)
  dmuon-owner      dmuon.torch.hold_on_owners + DMuon (the owner-centric mode)
  dmuon-a2a-f32,   the same two with float32 Newton–Schulz (ns_dtype="float32"); the two above ask for no dtype:
  dmuon-owner-f32  untuned the machine's default (bfloat16 on a CPU with bf16 matrix units, AMX, float32 elsewhere),
                   +tuned per shape the dtype dmuon.tune measured faster (bfloat16 and float32 both timed on a CPU
                   with bf16 instructions, AVX-512 BF16 or AMX). Not in the default --optimizers: ask for them

Each dmuon setting runs twice: without a tuning cache (tune_cache=None: untuned kernels, the owner
planner on flop costs; a cache at the default path is not read) and as `dmuon-a2a+tuned` /
`dmuon-owner+tuned`, with a cache that this run makes, before any timing of the model, in a temporary
folder (tune_cache=that path, to DMuon and hold_on_owners): rank 0 runs dmuon.tune (the engine
`dmuon tune` runs) while the other ranks wait, first for the requests `dmuon tune --ranks W` makes
(each Muon shape with batch ceil(count/W), what the owner planner's tuned costs ask for), then, after
building each tuned setting once untimed to learn its owners, for every (shape, batch) a rank's
buckets run that the cache still lacks; a tuned row whose buckets (re-planned when it is built again
for timing) still run a batch not tuned lists it in "untuned_batches" (the engine then uses the
nearest tuned batch). --no-tuned skips these rows.

    PYTHONPATH=build/python torchrun --standalone --nproc_per_node 2 python/benchmarks/fsdp2_owner_step.py \\
        [--models small,qwen4] [--tokens 256,1024] [--tp 1] [--micro-batches 1] [--param-dtype float32] [--steps 2]
        [--warmup 2] [--no-tuned] [--step-memory auto] [--json FILE]

--tp T (a comma-separated list, each its own setting) adds tensor parallelism: the ranks form a (W/T, T)
("dp", "tp") mesh, each block's q, k, v, gate and up column-wise and o and down row-wise over "tp"
(parallelize_module), fully_shard over "dp" on top, and each data-parallel rank's T ranks train the same
batch; dmuon-owner holds each TP slice on its owner's TP group (hold_on_owners(model, mesh["dp"])). Only
adamw, dmuon-a2a and dmuon-owner run with T > 1 (the others are skipped with a line). The wire bytes
count torch.distributed's collectives (FSDP2's, DMuon's, the held hooks'), not TP's own (DTensor's
functional collectives), which are the same for every optimizer.

The peers are not dependencies of dmuon: install them beside it for a run, e.g.
`pip install --no-deps --target /tmp/peers muon-fsdp2` and a checkout of microsoft/dion in /tmp/dion,
then PYTHONPATH=build/python:/tmp/peers:/tmp/dion; a peer that does not import is skipped with a line
saying why. Both peers and torch.optim.Muon orthogonalize in bfloat16 (their fixed choice; on a CPU
without bfloat16 instructions that is emulated and slow), dion-muon-f32 and the -f32 dmuon rows in float32.
dmuon-a2a-bf16 and dmuon-owner-bf16 are dmuon-a2a and dmuon-owner with DMuon(state_dtype=torch.bfloat16): Muon's
momentum and AdamW's moments in bfloat16 (docs/pytorch.md, "Optimizer state in bfloat16").

Models: "small", a GPT of width 128 (4 layers); "qwen4", qwen2.5-0.5b's layer shapes (4 layers: q and
o 896×896, k and v 128×896, gate and up 4864×896, down 896×4864) with a 4096-token vocabulary instead
of its 151936 (the embedding is AdamW's either way); "moe", "small" with each MLP replaced by 8 routed
experts of ffn 256, top-2 (torchtitan's layout: (E, ffn, dim) gate and up stacks, an (E, dim, ffn) down
stack, each expert its own Muon matrix; FSDP2 shards the stacks by experts). Every block and the root
under fully_shard.
Tokens per step are global (each rank trains tokens/W), in --micro-batches forward+backwards per step
(gradient accumulation: `set_requires_gradient_sync` on FSDP2's modules and on the owner-held matrices,
so that only the last micro-batch reduces). Per optimizer and setting, medians over
--steps timed steps after --warmup untimed ones, each the slowest rank's: the optimizer step, forward+backward,
the whole step, the communication the ranks were blocked on (in forward+backward and in the step:
a synchronous collective's call, an asynchronous one's wait()), and the wire bytes per step of the
whole job (nccl-tests' bus bytes; tests/python/collective_ledger.py), and of them those sent inside
the optimizer step.

Memory (a second table, per optimizer and setting, and in --json): after the timed steps, one more step, counted
by memory_count.py (its docstring says what is counted and how), every optimizer the same way, from the outside:
per rank the bytes held between steps (weights: the parameters as the rank stores them, the float32 masters under
--param-dtype bfloat16; state: the optimizers' `state`; other: any other tensor the optimizer, the model or the
held matrices keep, such as working copies; engine: the C++ engine's own buffers, its pooled Newton–Schulz
workspaces), the bytes
the forward+backward leaves for the step (gradients), and the peak of the step's own allocations above those
(a TorchDispatchMode counting live storages, plus the engine's growth; a peer's torch.compile'd
functions run eagerly in that step, as a dispatch mode cannot be compiled). Shown: the fullest rank (the
most held bytes) with its breakdown, the most weights + state of any rank, each against AdamW's, the highest
gradients and step peak of any rank, and for a dmuon row on the fullest rank its step's peak, the float32 bytes of
the largest Muon matrix it owns and of its largest Newton–Schulz batch (the matrices of one of its buckets), and the
peak over that matrix (--json: memory_per_rank, every rank's). --step-memory (auto, none or bytes) is the dmuon
rows' DMuon(step_memory=...), which bounds those batches (docs/pytorch.md).

"NS dtype": the Newton–Schulz compute dtype each optimizer ran, so precision shows beside time: the peers' fixed
choice (FIXED_NS_DTYPE), a dmuon row's every dtype any rank's engine ran (DMuon.ns_dtypes_ran; "bfloat16+float32"
where the tuner chose per shape).

Per dmuon row, three Newton–Schulz columns, all of the rank whose median optimizer step is the longest
(--json has every rank's: step_per_rank, ns_in_step_per_rank, blocked_step_per_rank, ns_pred_per_rank,
owned_batches_per_rank: a profile of where each rank's step goes):
  NS in step  the engine's time inside that rank's steps (DMuon.last_stats["ns_s"]; for a bucket the rank
              holds whole, the one call that also does its momentum and apply), median over the timed steps
  NS pred     the engine's time for the same work without the rest of the step: after the timed steps,
              each rank runs, with the optimizer's own Orthogonalizer (same settings, same cache), one call
              per bucket it owns matrices of, in the step's order, on random matrices of those shapes and
              counts, every rank at once after a barrier as in the step; --steps times, the median
  step/NS     that rank's median step time over its NS pred: 1.0 would be a step that is nothing but its
              Newton–Schulz; the rest is the step's other work (AdamW, momentum, copies, communication,
              waiting for the other ranks)
"""

import argparse
import gc
import importlib
import json
import math
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from dmuon.torch import DMuon, hold_on_owners
from dmuon.torch.mpirun import init_process_group
from dmuon.torch.matrices import matrices_of
from dmuon.torch.params import is_expert_stack_by_default, module_groups
from dmuon.torch.plan import work_dtype
from dmuon.torch.torch_engine import newton_schulz

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "python"))
from collective_ledger import Ledger, recording  # noqa: E402

from memory_count import StepAllocations, held_bytes, reachable_storages  # noqa: E402  (this file's folder)

OPTIMIZERS = ("adamw", "torch-muon", "muon-fsdp2", "dion-muon", "dion-muon-f32", "dmuon-a2a", "dmuon-owner",
              "dmuon-a2a-bf16", "dmuon-owner-bf16")
DMUON_F32 = {"dmuon-a2a-f32": "dmuon-a2a", "dmuon-owner-f32": "dmuon-owner"}  # float32 NS rows, asked for by name
DMUON_BF16 = {"dmuon-a2a-bf16": "dmuon-a2a", "dmuon-owner-bf16": "dmuon-owner"}  # state_dtype=bfloat16 rows
PEERS = ("torch-muon", "muon-fsdp2", "dion-muon", "dion-muon-f32")   # what a user would pick instead of dmuon
TWO_D_ONLY = ("torch-muon", "muon-fsdp2")  # refuse an (E, m, n) expert stack (torch.optim.Muon: "only supports 2D")
DMUON = ("dmuon-a2a", "dmuon-owner")
TUNED = "+tuned"  # the row of a dmuon setting run with this run's tuning cache
MODELS = {  # dim, heads, kv heads, ffn (per expert), layers, vocab[, experts, experts per token]
    "small": (128, 4, 4, 512, 4, 512),
    "qwen4": (896, 14, 2, 4864, 4, 4096),
    "moe": (128, 4, 4, 256, 4, 512, 8, 2),
}
SEQ = 64
TP_PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
           "gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}  # per block
TP_OPTIMIZERS = ("adamw", "dmuon-a2a", "dmuon-owner", *DMUON_F32, *DMUON_BF16)  # those that run with --tp > 1


class Experts(torch.nn.Module):
    """Routed experts as torchtitan's MoE lays them out: (E, ffn, dim) gate and up stacks and an (E, dim, ffn)
    down stack (each expert its own Muon matrix: "experts" in the names), a router, top-k gating; each expert
    runs on the tokens routed to it (a loop: no grouped-GEMM kernel on the CPU)."""

    def __init__(self, dim, ffn, experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Linear(dim, experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(experts, ffn, dim) / math.sqrt(dim))   # gate
        self.w3 = torch.nn.Parameter(torch.randn(experts, ffn, dim) / math.sqrt(dim))   # up
        self.w2 = torch.nn.Parameter(torch.randn(experts, dim, ffn) / math.sqrt(ffn))   # down

    def forward(self, h):  # h (N, D) → (N, D)
        weights, chosen = torch.topk(torch.softmax(self.router(h), dim=-1), self.top_k, dim=-1)  # (N, k) each
        out = torch.zeros_like(h)
        for e in range(self.w1.shape[0]):
            rows, slot = (chosen == e).nonzero(as_tuple=True)  # an expert may get no token: it still steps
            x = h[rows]
            y = (F.silu(x @ self.w1[e].T) * (x @ self.w3[e].T)) @ self.w2[e].T
            out = out.index_add(0, rows, y * weights[rows, slot, None])
        return out


class Block(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads, ffn, experts=0, top_k=0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attn_norm = torch.nn.RMSNorm(dim)
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.k = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = torch.nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)
        self.mlp_norm = torch.nn.RMSNorm(dim)
        self.experts = Experts(dim, ffn, experts, top_k) if experts else None
        if not experts:
            self.gate = torch.nn.Linear(dim, ffn, bias=False)
            self.up = torch.nn.Linear(dim, ffn, bias=False)
            self.down = torch.nn.Linear(ffn, dim, bias=False)

    def forward(self, x):  # x (B, T, D); under tensor parallelism each rank has H/T and Hkv/T of the heads
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, -1, self.head_dim).transpose(1, 2)       # (B, H, T, hd)
        k = self.k(h).view(b, t, -1, self.head_dim).transpose(1, 2)       # (B, Hkv, T, hd)
        v = self.v(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        if self.experts is not None:
            return x + self.experts(h.reshape(b * t, -1)).view_as(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class GPT(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads, ffn, layers, vocab, experts=0, top_k=0):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList([Block(dim, heads, kv_heads, ffn, experts, top_k) for _ in range(layers)])
        self.norm = torch.nn.RMSNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):  # (B, T) → (B, T, V)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# ---- the peers ----

class TorchMuonFsdp2(torch.optim.Optimizer):
    """torch.optim.Muon on full copies of the Muon matrices, fed all-gathered gradients on every rank
    (each rank orthogonalizes every matrix), each rank keeping its rows; torch.optim.AdamW for the rest."""

    def __init__(self, model, lr, adamw_lr):
        groups = module_groups(model)
        self.muon_params = [p for g in groups if g["use_muon"] for _, p in g["params"]]
        self.full = [torch.nn.Parameter(p.full_tensor().detach().clone()) for p in self.muon_params]
        self.muon = torch.optim.Muon(self.full, lr=lr, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW([p for g in groups if not g["use_muon"] for _, p in g["params"]], lr=adamw_lr)
        super().__init__(self.full, {})

    @torch.no_grad()
    def step(self, closure=None):
        for p, full in zip(self.muon_params, self.full):
            local = p.grad.to_local().contiguous()
            gathered = local.new_empty((local.shape[0] * dist.get_world_size(),) + tuple(local.shape[1:]))
            dist.all_gather_into_tensor(gathered, local)   # rows divide by the ranks in these models
            full.grad = gathered
        self.muon.step()
        for p, full in zip(self.muon_params, self.full):
            rows = p.to_local().shape[0]
            p.to_local().copy_(full[dist.get_rank() * rows:(dist.get_rank() + 1) * rows])
        self.adamw.step()

    def zero_grad(self, set_to_none=True):
        self.adamw.zero_grad(set_to_none)
        for p in self.muon_params:
            p.grad = None


PEER_MODULES = {"muon-fsdp2": "muon_fsdp2", "dion-muon": "dion", "dion-muon-f32": "dion"}
# The Newton–Schulz compute dtype of the optimizers that fix one (the table's "NS dtype"; a dmuon row's is what its
# engine ran, DMuon.ns_dtypes_ran): torch.optim.Muon and the peers' defaults bfloat16, dion-muon-f32 float32.
FIXED_NS_DTYPE = {"adamw": "-", "torch-muon": "bfloat16", "muon-fsdp2": "bfloat16", "dion-muon": "bfloat16",
                  "dion-muon-f32": "float32"}


def newton_schulz_f32(u, epsilon=1e-7, steps=5):
    """dion's newton_schulz_func contract: u (..., rows, cols), any float dtype → the orthogonalized u in
    u's dtype. Keller's quintic in float32 (dmuon.torch's torch engine, its standard recurrence)."""
    return newton_schulz(u, "keller", steps, "standard", torch.float32, eps=epsilon).to(u.dtype)


def peer_module(name):
    """The peer's module, or the reason it does not import (a str)."""
    try:
        return importlib.import_module(PEER_MODULES[name])
    except Exception as error:  # an optional peer: any failure to import skips it
        return f"{type(error).__name__}: {error}"


def meshes(tp):
    """(the data-parallel mesh fully_shard gets, the TP mesh or None) of the world with tensor parallelism T."""
    world = dist.get_world_size()
    if tp == 1:
        return init_device_mesh("cpu", (world,)), None
    if world % tp:
        raise SystemExit(f"fsdp2_owner_step: --tp {tp} does not divide the {world} ranks")
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def build(name, config, tp, mp_policy, tune_cache=None, step_memory="auto", lr=0.02, adamw_lr=3e-3):
    """(the model under parallelize_module over "tp" when tp > 1 and fully_shard(mp_policy=...) over the
    data-parallel mesh, its optimizer, HeldMatrices for dmuon-owner(-f32) or None); tune_cache: the dmuon
    settings' (None: none); step_memory: DMuon's"""
    ns_dtype = "float32" if name in DMUON_F32 else None  # None: the machine's default
    state_dtype = torch.bfloat16 if name in DMUON_BF16 else torch.float32
    name = DMUON_F32.get(name, DMUON_BF16.get(name, name))
    torch.manual_seed(0)
    model = GPT(*config)
    mesh, tp_mesh = meshes(tp)
    if tp_mesh is not None:
        for block in model.blocks:
            parallelize_module(block, tp_mesh, TP_PLAN)
    held = hold_on_owners(model, mesh, tune_cache=tune_cache) if name == "dmuon-owner" else None
    ignored = held.params if held is not None else None
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ignored, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, ignored_params=ignored, mp_policy=mp_policy)
    if name == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=adamw_lr), held
    if name == "torch-muon":
        return model, TorchMuonFsdp2(model, lr, adamw_lr), held
    if name == "muon-fsdp2":
        return model, peer_module(name).Muon(
            [dict(params=[p for _, p in g["params"]], use_muon=g["use_muon"], lr=lr if g["use_muon"] else adamw_lr)
             for g in module_groups(model)]), held
    if name in ("dion-muon", "dion-muon-f32"):
        custom = dict(newton_schulz_func=newton_schulz_f32) if name == "dion-muon-f32" else {}
        return model, peer_module(name).Muon(
            [dict(params=[p for _, p in g["params"]]) if g["use_muon"] else
             dict(params=[p for _, p in g["params"]], algorithm="adamw", lr=adamw_lr) for g in module_groups(model)],
            distributed_mesh=mesh, lr=lr, adjust_lr="rms_norm", **custom), held
    return model, DMuon(model, lr=lr, adamw_lr=adamw_lr, tune_cache=tune_cache, ns_dtype=ns_dtype,
                        state_dtype=state_dtype, step_memory=step_memory), held


def slowest(value):
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def total(value):
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def set_gradient_sync(model, held, sync):
    """Gradient accumulation as FSDP2 users write it: only the last micro-batch's backward reduces."""
    model.set_requires_gradient_sync(sync)
    if held is not None:
        held.set_requires_gradient_sync(sync)


# ---- the +tuned rows' cache, and Newton–Schulz alone ----

def gathered(value):
    """Every rank's value, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def owned_buckets(opt):
    """What this rank's Newton–Schulz runs in a step of DMuon `opt`: per bucket (the optimizer's, in the
    step's order) with matrices this rank owns, (rows, cols, how many, the dtype the engine gets them in)."""
    out = []
    for bucket in opt._buckets:
        owned = [k for k in bucket if k.owner == opt.comm.rank]
        if owned:
            k = owned[0]
            ns_dtype = opt.engine.ns_dtype(k.layout.local(k.layout.tensor).device, work_dtype(k.group, k.layout.tensor))
            out.append((k.rows, k.cols, len(owned), ns_dtype))
    return out


def muon_requests(config, world):
    """The (rows, cols, batch) requests `dmuon tune --ranks W` makes for this model (the engine's
    tune_requests, which the C ABI does not export): each Muon shape of DMuon's routing with batch
    ceil(count/W), the batches the owner planner's tuned costs ask for."""
    with torch.device("meta"):
        model = GPT(*config)
    counts = {}
    for g in module_groups(model):
        if g["use_muon"]:
            for n, p in g["params"]:
                for _, rows, cols in matrices_of(tuple(p.shape), is_expert_stack_by_default(n, tuple(p.shape))):
                    counts[(rows, cols)] = counts.get((rows, cols), 0) + 1
    return sorted((rows, cols, -(-n // world)) for (rows, cols), n in counts.items())


class Tuner:
    """This run's tuning cache: tune.json in a temporary folder (removed by close()), which rank 0 fills with
    dmuon.tune while the other ranks wait for a file that says it is done (a large shape can take longer to
    tune than the process group's timeout, so they do not wait in a collective)."""

    def __init__(self):
        folder = [tempfile.mkdtemp(prefix="dmuon-fsdp2-bench-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(folder)
        self.folder = folder[0]
        self.path = os.path.join(self.folder, "tune.json")
        self.tuned = set()   # (rows, cols, batch) in the cache
        self.times = {}      # rank 0: (rows, cols, batch) → (tuned kernel's seconds, untuned one's, its dtype)
        self.calls = 0

    def tune(self, requests):
        """Tunes the requests (the same on every rank) that the cache lacks. Collective."""
        todo = sorted(set(requests) - self.tuned)
        if not todo:
            return
        done = os.path.join(self.folder, f"done.{self.calls}")
        self.calls += 1
        if dist.get_rank() == 0:
            t0 = time.perf_counter()
            error = ""
            try:
                dmuon.tune(todo, threads=torch.get_num_threads(), tune_cache=self.path)
            except Exception as e:  # every rank raises it below
                error = f"{type(e).__name__}: {e}"
            pathlib.Path(done + ".part").write_text(error)
            os.replace(done + ".part", done)
            if not error:  # each entry of the cache file holds both times (seconds, default_seconds)
                for setting in json.loads(pathlib.Path(self.path).read_text())["settings"]:
                    for e in setting["entries"]:
                        self.times[(e["rows"], e["cols"], e["batch"])] = (e["seconds"], e["default_seconds"],
                                                                          e["dtype"])
            def times(q):
                tuned, untuned, dtype = self.times.get(q, (math.nan, math.nan, "?"))
                return f"{1e3 * tuned:.1f} ms in {dtype} (untuned {1e3 * untuned:.1f} ms)"
            print(f"tuned on rank 0 in {time.perf_counter() - t0:.1f} s ({torch.get_num_threads()} BLAS threads); "
                  "the chosen kernel's time as the tuner measured it: "
                  + "; ".join(f"{r}x{c} batch {b}: {times((r, c, b))}" for r, c, b in todo), flush=True)
        else:
            while not os.path.exists(done):
                time.sleep(0.5)
        error = pathlib.Path(done).read_text()
        if error:
            raise RuntimeError(f"fsdp2_owner_step: dmuon.tune on rank 0 failed: {error}")
        self.tuned.update(todo)
        dist.barrier()

    def prepare(self, names, config, tp, mp_policy, step_memory):
        """The cache for the tuned dmuon settings `names` of this model, before any of its timings: the
        planner's requests, then every (shape, batch) the ranks' buckets run once built with them (and
        step_memory)."""
        world = dist.get_world_size()
        self.tune(muon_requests(config, world))
        for name in names:
            model, opt, held = build(name, config, tp, mp_policy, self.path, step_memory)
            mine = [(r, c, n) for r, c, n, _ in owned_buckets(opt)]
            del model, opt, held
            gc.collect()
            self.tune({q for rank_requests in gathered(mine) for q in rank_requests})

    def close(self):
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(self.folder, ignore_errors=True)


def ns_alone(opt, buckets, repeats):
    """Seconds this rank's engine takes for `buckets` (owned_buckets) alone, per repeat: random matrices,
    one call per bucket by the optimizer's engine and Newton–Schulz handle, every rank at once after a barrier."""
    gen = torch.Generator().manual_seed(2 + dist.get_rank())
    inputs = [torch.randn((n, rows, cols), generator=gen).to(dtype) for rows, cols, n, dtype in buckets]
    work = [t.clone() for t in inputs]
    times = []
    for _ in range(repeats):
        for w, t in zip(work, inputs):
            w.copy_(t)
        dist.barrier()
        seconds = 0.0
        for w in work:
            matrices = list(w)
            t0 = time.perf_counter()
            opt.engine.orthogonalize(opt.ns, matrices, None)
            seconds += time.perf_counter() - t0
        times.append(seconds)
    return times


def measure(name, config, tokens, tp, micro_batches, steps, warmup, mp_policy, budget, tuner=None):
    """tuner: the +tuned row's (its cache), None for the untuned one (tune_cache=None); budget: DMuon's step_memory."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dp, dp_rank = world // tp, rank // tp  # the T ranks of a TP group train the same batch
    if dmuon.library_error() is None:
        dmuon.release_workspaces()  # the engine's pooled workspaces in this row's memory table are its own
    model, opt, held = build(name, config, tp, mp_policy, tuner.path if tuner else None, budget)
    batch = max(1, tokens // SEQ // dp // micro_batches)  # sequences per data-parallel rank and micro-batch
    gen = torch.Generator().manual_seed(1)
    ledger = Ledger()
    rows = []
    also = [sys.modules[m] for m in ("muon_fsdp2",) if m in sys.modules]  # imports the collectives by name
    def batches():  # this data-parallel rank's micro-batches of the next step: (micro_batches, batch, SEQ + 1)
        return torch.randint(0, config[5], (dp, micro_batches, batch, SEQ + 1), generator=gen)[dp_rank]

    with recording(ledger, also=also):
        for step in range(warmup + steps):
            data = batches()
            ledger.records.clear()
            ledger.label = None
            dist.barrier()
            ledger.label = "forward+backward"
            t0 = time.perf_counter()
            loss = forward_backward(model, held, data, config[5])
            t1 = time.perf_counter()
            ledger.label = "step"
            opt.step()
            opt.zero_grad()
            t2 = time.perf_counter()
            ledger.label = None
            rows.append(dict(fwd_bwd=t1 - t0, step=t2 - t1, total=t2 - t0,
                             blocked_fwd_bwd=ledger.blocked("forward+backward"), blocked_step=ledger.blocked("step"),
                             wire=ledger.wire("forward+backward") + ledger.wire("step"), wire_step=ledger.wire("step"),
                             loss=loss.item(), ns=opt.last_stats["ns_s"] if isinstance(opt, DMuon) else math.nan))
    timed = rows[warmup:]
    out = {key: statistics.median(slowest(r[key]) for r in timed)
           for key in ("fwd_bwd", "step", "total", "blocked_fwd_bwd", "blocked_step")}
    out.update(memory_of_ranks(gathered(dict(step_memory(model, opt, held, batches(), config[5]),
                                             **owned_bytes(opt)))))
    out["wire_bytes"] = statistics.median(total(r["wire"]) for r in timed)
    out["wire_bytes_in_step"] = statistics.median(total(r["wire_step"]) for r in timed)
    out["loss_last"] = timed[-1]["loss"]
    out.update(ns_in_step=math.nan, ns_pred=math.nan, step_vs_ns_pred=math.nan, ns_dtype=FIXED_NS_DTYPE.get(name))
    if isinstance(opt, DMuon):
        out["ns_dtype"] = "+".join(sorted({d for ran in gathered(opt.ns_dtypes_ran) for d in ran}))
        buckets = owned_buckets(opt)
        mine = dict(step=statistics.median(r["step"] for r in timed),
                    ns_in_step=statistics.median(r["ns"] for r in timed),
                    blocked_step=statistics.median(r["blocked_step"] for r in timed),
                    ns_pred=statistics.median(ns_alone(opt, buckets, steps)),
                    batches=[(r, c, n) for r, c, n, _ in buckets])
        ranks = gathered(mine)
        slow = max(range(world), key=lambda r: ranks[r]["step"])
        out.update(slowest_rank=slow, ns_in_step=ranks[slow]["ns_in_step"], ns_pred=ranks[slow]["ns_pred"],
                   step_vs_ns_pred=(ranks[slow]["step"] / ranks[slow]["ns_pred"] if ranks[slow]["ns_pred"] > 0
                                    else math.nan),
                   step_per_rank=[r["step"] for r in ranks], ns_in_step_per_rank=[r["ns_in_step"] for r in ranks],
                   blocked_step_per_rank=[r["blocked_step"] for r in ranks],
                   ns_pred_per_rank=[r["ns_pred"] for r in ranks], owned_batches_per_rank=[r["batches"] for r in ranks],
                   tune_cache="this run's" if tuner else None, tuned_entries=opt.ns.tuned_entries)
        if tuner:
            missing = sorted({tuple(q) for r in ranks for q in r["batches"]} - tuner.tuned)
            out["untuned_batches"] = missing
            out["tuner_seconds"] = [dict(rows=q[0], cols=q[1], batch=q[2], tuned=t[0], untuned=t[1], dtype=t[2])
                                    for q, t in sorted(tuner.times.items())] if rank == 0 else None
            if missing and rank == 0:
                print(f"{name}{TUNED}: the ranks' buckets run (shape, batch) not in the cache: {missing}", flush=True)
    return out


def forward_backward(model, held, data, vocab):
    """The forward+backwards of one step on data (micro-batches, batch, SEQ + 1); the last micro-batch's loss."""
    for k, part in enumerate(data):  # part (batch, SEQ + 1)
        if len(data) > 1:
            set_gradient_sync(model, held, k == len(data) - 1)
        logits = model(part[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), part[:, 1:].reshape(-1))
        (loss / len(data)).backward()
    return loss


def step_memory(model, opt, held, data, vocab):
    """This rank's memory around one more step (memory_count.py), after the timed ones so that counting slows none of
    them: what it holds between steps (held_bytes: weights, state, other, engine, total), what the forward+backward
    left for the step (gradients: storages reachable then that were not between steps) and the step's transient
    peak above both (StepAllocations' peak: its allocations and the engine's growth)."""
    also = [held] if held is not None else []
    kept = held_bytes(model, opt, also)
    between = reachable_storages([opt, model, *also])
    forward_backward(model, held, data, vocab)
    entry = reachable_storages([opt, model, *also])
    # A dispatch mode cannot be compiled: a peer's torch.compile'd functions (muon-fsdp2's Newton–Schulz) run eagerly
    # in the counted step, their temporaries those of eager torch.
    with torch.compiler.set_stance("force_eager"), StepAllocations(existing=entry.values()) as count:
        opt.step()
    opt.zero_grad()
    return dict(kept, gradients=sum(s.nbytes() for k, s in entry.items() if k not in between), step_peak=count.peak)


def owned_bytes(opt):
    """The float32 bytes of the largest Muon matrix this rank owns and of its largest Newton–Schulz batch (matrices
    × rows × cols of an owned bucket), for DMuon `opt`; NaN for another optimizer."""
    if not isinstance(opt, DMuon):
        return dict(largest_matrix=math.nan, largest_batch=math.nan)
    buckets = owned_buckets(opt)
    return dict(largest_matrix=max((4 * r * c for r, c, _, _ in buckets), default=0),
                largest_batch=max((4 * r * c * n for r, c, n, _ in buckets), default=0))


def memory_of_ranks(ranks):
    """The memory columns from every rank's step_memory and owned_bytes (in rank order): the fullest rank (the most
    held bytes) and its breakdown, its step peak and largest owned matrix, the most weights + state of a rank (the
    issue's measure), the highest step peak and its rank."""
    fullest = max(range(len(ranks)), key=lambda r: ranks[r]["total"])
    peak = max(range(len(ranks)), key=lambda r: ranks[r]["step_peak"])
    return dict(memory_per_rank=ranks, fullest_rank=fullest, held_fullest=ranks[fullest],
                weights_state_fullest=max(r["weights"] + r["state"] for r in ranks),
                gradients_max=max(r["gradients"] for r in ranks), step_peak_rank=peak,
                step_peak_max=ranks[peak]["step_peak"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="small,qwen4")
    parser.add_argument("--tokens", default="256,1024", help="global tokens per step, comma-separated")
    parser.add_argument("--tp", default="1", help="tensor-parallel sizes, comma-separated (1: FSDP2 alone)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="forward+backwards per step, each of tokens/K; only the last reduces gradients")
    parser.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="bfloat16: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on every "
                             "fully_shard (the held matrices follow it)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per optimizer and setting")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--no-tuned", action="store_true",
                        help="skip the dmuon settings' +tuned rows (and the tuning they need)")
    parser.add_argument("--step-memory", default="auto",
                        help="DMuon's step_memory for the dmuon rows: auto, none, or bytes")
    parser.add_argument("--json", default=None, help="also write the results to this file (rank 0)")
    args = parser.parse_args()
    budget = None if args.step_memory == "none" else (args.step_memory if args.step_memory == "auto"
                                                       else int(args.step_memory))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if args.param_dtype == "bfloat16" else MixedPrecisionPolicy())
    rank, world = init_process_group("gloo")
    requested = args.optimizers.split(",")
    unknown = [n for n in requested if n not in OPTIMIZERS and n not in DMUON_F32]
    if unknown:
        raise SystemExit(f"fsdp2_owner_step: unknown --optimizers {', '.join(unknown)} (known: "
                         f"{', '.join((*OPTIMIZERS, *DMUON_F32))})")
    skipped = {n: peer_module(n) for n in requested if n in PEER_MODULES and isinstance(peer_module(n), str)}
    names = [n for n in requested if n not in skipped]
    if rank == 0:
        for n, why in skipped.items():
            print(f"{n}: not run, `import {PEER_MODULES[n]}` failed ({why})", flush=True)
    runs = [(n, tuned) for n in names for tuned in ((False, True) if n in DMUON and not args.no_tuned else (False,))]
    tuned_names = [n for n, tuned in runs if tuned]
    tuner = Tuner() if tuned_names else None
    results = []
    for model_name, tp in [(m, int(t)) for m in args.models.split(",") for t in args.tp.split(",")]:
        config = MODELS[model_name]
        if tp > 1 and len(config) > 6:
            raise SystemExit(f"fsdp2_owner_step: --tp {tp} with {model_name}: the benchmark has no expert-parallel "
                             "plan")
        if config[2] % tp:
            raise SystemExit(f"fsdp2_owner_step: --tp {tp} does not divide {model_name}'s {config[2]} key-value heads")
        tp_runs = [(n, tuned) for n, tuned in runs if tp == 1 or n in TP_OPTIMIZERS]
        if rank == 0 and len(tp_runs) < len(runs):
            print(f"--tp {tp}: {', '.join(sorted({n for n, _ in runs} - {n for n, _ in tp_runs}))} not run "
                  f"(with tensor parallelism only {', '.join(TP_OPTIMIZERS)} run)", flush=True)
        if len(config) > 6:
            stacked = [n for n, _ in tp_runs if n in TWO_D_ONLY]
            tp_runs = [(n, tuned) for n, tuned in tp_runs if n not in TWO_D_ONLY]
            if rank == 0 and stacked:
                print(f"{model_name}: {', '.join(stacked)} not run (2-D parameters only; the experts are (E, m, n) "
                      "stacks)", flush=True)
        if tuner:
            tuner.prepare([n for n, tuned in tp_runs if tuned], config, tp, policy, budget)
        for tokens in [int(t) for t in args.tokens.split(",")]:
            setting = []
            for name, tuned in tp_runs:
                r = measure(name, config, tokens, tp, args.micro_batches, args.steps, args.warmup, policy, budget,
                            tuner if tuned else None)
                setting.append(dict(model=model_name, world=world, tp=tp, tokens=tokens,
                                    micro_batches=args.micro_batches, param_dtype=args.param_dtype,
                                    step_memory=args.step_memory,
                                    optimizer=name + (TUNED if tuned else ""),
                                    load_average_1min=os.getloadavg()[0], **r))
            base = next(r for r in setting if r["optimizer"] == "adamw") if "adamw" in names else None
            peers = [r["step"] for r in setting if r["optimizer"] in PEERS]
            for r in setting:
                r["total_vs_adamw"] = r["total"] / base["total"] if base else math.nan
                r["held_vs_adamw"] = r["held_fullest"]["total"] / base["held_fullest"]["total"] if base else math.nan
                r["weights_state_vs_adamw"] = (r["weights_state_fullest"] / base["weights_state_fullest"] if base
                                               else math.nan)
                r["bytes_vs_adamw"] = r["wire_bytes"] / base["wire_bytes"] if base and base["wire_bytes"] else math.nan
                r["step_speedup_vs_fastest_peer"] = (min(peers) / r["step"] if peers and r["optimizer"] != "adamw"
                                                     else math.nan)
            results.extend(setting)
            if rank == 0:
                print_table(setting)
                print_memory_table(setting)
    if tuner:
        tuner.close()
    if rank == 0:
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def print_table(setting):
    first = setting[0]
    parallel = f"FSDP2 {first['world'] // first['tp']} x TP {first['tp']}" if first["tp"] > 1 else "FSDP2"
    print(f"\n{first['model']}, {first['world']} ranks ({parallel}), {first['tokens']} tokens per step in "
          f"{first['micro_batches']} "
          f"micro-batch(es) (times in ms, slowest rank; "
          f"1-minute load average {first['load_average_1min']:.1f} to {setting[-1]['load_average_1min']:.1f})")
    print("| optimizer | NS dtype | step | fwd+bwd | total | total vs AdamW | blocked in fwd+bwd | blocked in step "
          "| wire bytes/step | of which in step | bytes vs AdamW | step speedup vs fastest peer "
          "| NS in step | NS pred | step/NS |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    def ratio(x, unit=""):
        return "-" if math.isnan(x) else f"{x:.3f}{unit}"

    def ms(x):
        return "-" if math.isnan(x) else f"{1e3 * x:.1f}"

    for r in setting:
        print(f"| {r['optimizer']} | {r['ns_dtype']} | {1e3 * r['step']:.1f} | {1e3 * r['fwd_bwd']:.1f} | "
              f"{1e3 * r['total']:.1f} | "
              f"{ratio(r['total_vs_adamw'])} | {1e3 * r['blocked_fwd_bwd']:.1f} | {1e3 * r['blocked_step']:.1f} | "
              f"{int(r['wire_bytes'])} | {int(r['wire_bytes_in_step'])} | {ratio(r['bytes_vs_adamw'])} | {ratio(r['step_speedup_vs_fastest_peer'], 'x')} | "
              f"{ms(r['ns_in_step'])} | {ms(r['ns_pred'])} | {ratio(r['step_vs_ns_pred'])} |",
              flush=True)


def print_memory_table(setting):
    first = setting[0]
    print(f"\n{first['model']}, {first['world']} ranks: memory per rank in MiB (memory_count.py), held between steps on "
          "the fullest rank (the most held bytes), the most weights + state of any rank, and the most of any rank "
          "left by the forward+backward for the step and allocated by the step above that; on the fullest rank "
          "its step's peak, the float32 bytes of the largest matrix it owns and of its largest Newton–Schulz batch")
    print("| optimizer | fullest rank | weights | state | other | engine buffers | held | held vs AdamW "
          "| weights + state (fullest) | vs AdamW | gradients at the step | step's peak above held (rank) "
          "| fullest: step's peak | largest owned matrix | largest NS batch | peak / largest matrix |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def mib(x):
        return "-" if math.isnan(x) else f"{x / 2**20:.1f}"

    def ratio(x):
        return "-" if math.isnan(x) else f"{x:.3f}"

    for r in setting:
        h = r["held_fullest"]
        print(f"| {r['optimizer']} | {r['fullest_rank']} | {mib(h['weights'])} | {mib(h['state'])} | {mib(h['other'])} "
              f"| {mib(h['engine'])} | {mib(h['total'])} | {ratio(r['held_vs_adamw'])} "
              f"| {mib(r['weights_state_fullest'])} | {ratio(r['weights_state_vs_adamw'])} | {mib(r['gradients_max'])} "
              f"| {mib(r['step_peak_max'])} ({r['step_peak_rank']}) | {mib(h['step_peak'])} "
              f"| {mib(h['largest_matrix'])} | {mib(h['largest_batch'])} "
              f"| {ratio(h['step_peak'] / h['largest_matrix'] if h['largest_matrix'] else math.nan)} |", flush=True)


if __name__ == "__main__":
    main()
