"""dmuon.torch.DMuon (all-to-all mode) under tensor parallelism, FSDP2 over TP, expert parallelism and
pipeline stages, on gloo (CPU), against muon_reference.py's float64 single-process Reference (Muon with
float64 Newton–Schulz and AdamW's rule on full tensors, fed the same gradients).

Run: OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node N \
         tests/python/torch_tp_ep_test.py            (N = 2, 4 or 8; PYTHONPATH with dmuon)
  layouts   parameters of uneven shapes laid out with distribute_tensor, full gradients from a seed (the
            same on every rank), STEPS steps, each layout on its own optimizer:
              N=2  TP: column-wise Shard(0), row-wise Shard(1) (a column block per rank), a replicated
                   matrix, _StridedShard(0, 3) (several row runs per rank), biases Shard(0) / Replicate()
              N=4  FSDP2 × TP on a (dp 2, tp 2) mesh: (_StridedShard(0, 2), Shard(0)) and (Shard(0), Shard(1));
                   HSDP × TP (Replicate(), Shard(d)); a 3-D (2, 1, 2) mesh; EP × expert-FSDP stacks (E, m, n)
                   with (Shard(0), Shard(1)) and (Shard(0), _StridedShard(1, 2)), one expert's gradient zero
                   at every step (an expert that got no tokens)
              N=8  HSDP × FSDP2 × TP on a (replicate 2, dp 2, tp 2) mesh, an expert stack among them
  models    a two-block MLP and Hugging Face transformers' Qwen2 (from a small config, its own
            base_model_tp_plan applied with torch's parallelize_module) trained STEPS steps on a global batch,
            DMuon(model): N=2 tensor parallelism alone; N=4 the same over a (dp 2, tp 2) mesh with
            fully_shard on "dp" on top (FSDP2 over TP: _StridedShard; the norms, embedding and head are
            DTensors on the "dp" slice); N=8 (the MLP) HSDP on ("replicate", "dp") of a (2, 2, 2) mesh.
            N=4 also transformers' Qwen3-MoE laid out by transformers itself (its DistributedConfig with
            fsdp 2 × tp 2 and experts on ep 2 × efsdp 2: its own TP, EP and FSDP2 plans, tokens to the
            experts by all-to-all), 3 steps; every expert whole on one rank, where step() leaves it; and
            at fsdp 4 with the same experts in both modes (owner-held: each expert stack's EP slices held on
            the owner's EP group, hold_on_owners over "efsdp", and the other matrices by a second call over
            "fsdp"), the held stacks' gradients at step 0 bit for bit FSDP2's. N=4 also the MLP owner-held under FSDP2 × TP after a meta-device init, and
            with a bfloat16 MixedPrecisionPolicy bit for bit the all-to-all mode's (check_held_tp_habits).
            Also in the owner-held mode (hold_on_owners after parallelize_module, before
            fully_shard: each TP slice held on its owner's TP group; at N=4 and 8 given the whole mesh, whose
            data-parallel dims it takes), then its state dicts: the full one
            equal to the weights, and a DCP save, the held slices zeroed, a DCP load, bit for bit
  pipeline  N=4: two stages of two ranks, one DMuon per stage over its stage's process group and mesh
  refusals  N=2: a conv filter sharded on its input channels, a Partial() parameter, and what hold_on_owners
            does not take under TP or EP (TP slices beside a matrix TP leaves whole, a matrix replicated over
            TP, an expert stack split within its experts, a conv filter under TP, a model fully_shard has
            sharded): the same ValueError on every rank, naming the parameter and the reason
  normuon   every layout again with variant="normuon" (its per-row v travels with the pieces): the copies,
            and norm checks below (the float64 reference is Muon's, and v adds to the bytes)
Each layout and the model check, per tensor after STEPS steps:
  params    against the float64 reference within TOLERANCE (layout_checks': 1e-5 relative, Frobenius;
            float32 Newton–Schulz and float32 elementwise updates on the same gradients);
  copies    bit-identical to DMuon on replicated plain copies fed the same full gradients (layouts only):
            the pieces' momentum and update are the same float32 elementwise operations on the same values,
            and each matrix's Newton–Schulz one engine call on the same U, whichever rank owns it;
  norm      DMuon's global gradient norm at every step against the reference's (each element counted
            once, whatever its replicas; a replicated matrix's gradient given Partial() at 2 ranks);
  ns        every Muon matrix (each expert) orthogonalized once per step, summed over ranks;
  bytes     step()'s all-to-all bytes (the last step's, over all ranks) equal each piece of U crossing once
            to its owner and each piece of O once back to every other holder (printed; the models' from
            collective_ledger.py, with forward + backward's: the owner-held mode's within 1.05x the
            all-to-all mode's, which are FSDP2's, as AdamW's with the same parallelism).
"""

import contextlib
import datetime
import functools
import math
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from collective_ledger import Ledger, recording
from layout_checks import (HYPER, TOLERANCE, U_F32, Checks, CollectiveBytes, all_ranks_sum, expect_same_error,
                           relative_error)
from muon_reference import Reference
from dmuon.torch import DMuon, clip_grad_norm_, hold_on_owners
from dmuon.torch.held.placeholder import HeldElsewhere
from dmuon.torch.params import module_groups
from rank_checks import failures, finish
from rank_exit import exit_rank
from tp_cases import BATCH, full_of, qwen2_batch, qwen2_case, tp_and_fsdp2

STEPS = 4
ZERO_EXPERT = 2  # the expert whose gradient is zero at every step


def is_muon(name, shape):
    return len(shape) >= 2 and "norm" not in name and "bias" not in name


def matrix_count(shapes):
    return sum(s[0] if len(s) == 3 else 1 for n, s in shapes.items() if is_muon(n, s))


def full_values(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) / math.sqrt(s[-1]) for n, s in shapes.items()}


def distribute(full, mesh, placements):
    """full (the same on every rank) as a DTensor, each rank splitting its own part (src_data_rank=None:
    torch scatters only even _StridedShard parts)."""
    return distribute_tensor(full, mesh, placements, src_data_rank=None)


def layouts(world):
    """[(case name, mesh shape, mesh dim names, {parameter: (global shape, placements)})]."""
    if world == 8:
        return [("hsdp x fsdp2 x tp (2, 2, 2)", (2, 2, 2), ("replicate", "dp", "tp"), {
            "blocks.0.up.weight": ((21, 16), (Replicate(), _StridedShard(0, split_factor=2), Shard(0))),
            "blocks.0.down.weight": ((16, 21), (Replicate(), Shard(0), Shard(1))),
            "blocks.0.moe.experts.w1": ((5, 6, 4), (Replicate(), Shard(0), Shard(1))),
            "blocks.0.norm.weight": ((16,), (Replicate(), Shard(0), Replicate())),
        })]
    if world == 2:
        return [("tp", (2,), ("tp",), {
            "blocks.0.up.weight": ((21, 16), (Shard(0),)),
            "blocks.0.up.bias": ((21,), (Shard(0),)),
            "blocks.0.down.weight": ((16, 21), (Shard(1),)),
            "blocks.0.norm.weight": ((16,), (Replicate(),)),
            "blocks.0.gate.weight": ((12, 12), (Replicate(),)),  # its gradient arrives Partial() (below)
            "blocks.0.strided.weight": ((10, 7), (_StridedShard(0, split_factor=3),)),
        })]
    return [
        ("fsdp2 x tp", (2, 2), ("dp", "tp"), {
            "blocks.0.up.weight": ((21, 16), (_StridedShard(0, split_factor=2), Shard(0))),
            "blocks.0.up.bias": ((21,), (_StridedShard(0, split_factor=2), Shard(0))),
            "blocks.0.down.weight": ((16, 21), (Shard(0), Shard(1))),
            "blocks.0.norm.weight": ((16,), (Shard(0), Replicate())),
        }),
        ("hsdp x tp", (2, 2), ("replicate", "tp"), {
            "blocks.0.up.weight": ((21, 16), (Replicate(), Shard(0))),
            "blocks.0.down.weight": ((16, 21), (Replicate(), Shard(1))),
        }),
        ("3-D mesh (2, 1, 2)", (2, 1, 2), ("replicate", "shard", "tp"), {
            "blocks.0.up.weight": ((21, 16), (Replicate(), Shard(0), Shard(0))),
            "blocks.0.down.weight": ((16, 21), (Replicate(), Shard(0), Shard(1))),
        }),
        ("ep x efsdp", (2, 2), ("ep", "efsdp"), {
            "blocks.0.moe.experts.w1": ((5, 6, 4), (Shard(0), Shard(1))),
            "blocks.0.moe.experts.w2": ((4, 7, 5), (Shard(0), _StridedShard(1, split_factor=2))),
            "blocks.0.moe.router.weight": ((5, 4), (Replicate(), Replicate())),
        }),
    ]


def check_layout(checks, name, mesh_shape, dim_names, spec, hyper=HYPER):
    """hyper: DMuon's options; with variant="normuon" (its v normalizes O per row: not the float64 reference's
    Muon, and v's rows ride with the pieces) only the checks that do not depend on the variant run, and the
    bit-for-bit one against DMuon on replicated copies."""
    normuon = hyper.get("variant") == "normuon"
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=dim_names)
    shapes = {n: s for n, (s, _) in spec.items()}
    # A replicated matrix's gradient as tensor parallelism can leave it: Partial(), rank 0 holding 2g and
    # rank 1 -g (DMuon redistributes it to the parameter's placements: 2g - g == g exactly; read alone,
    # rank 0's part would double the global gradient norm).
    partial = [n for n, (_, p) in spec.items()
               if len(p) == 1 and isinstance(p[0], Replicate) and is_muon(n, shapes[n])]
    initial = full_values(shapes, seed=1)
    params = {n: torch.nn.Parameter(distribute(initial[n], mesh, p)) for n, (_, p) in spec.items()}
    copies = {n: torch.nn.Parameter(initial[n].clone()) for n in spec}

    def groups(ps):
        return [{"params": [(n, p) for n, p in ps.items() if is_muon(n, shapes[n])], "use_muon": True},
                {"params": [(n, p) for n, p in ps.items() if not is_muon(n, shapes[n])], "use_muon": False}]
    opt, copies_opt = DMuon(groups(params), **hyper), DMuon(groups(copies), **hyper)
    ref = Reference.of_muon_names(initial, [n for n in shapes if is_muon(n, shapes[n])], HYPER, "match_rms_adamw")
    ns, norm_errors = [], {}
    for step in range(STEPS):
        grads = full_values(shapes, seed=10 + step)
        for n, g in grads.items():
            if g.dim() == 3:
                g[ZERO_EXPERT] = 0
            params[n].grad = (DTensor.from_local(g * (2 - 3 * dist.get_rank()), mesh, [Partial()]) if n in partial
                              else distribute(g, mesh, spec[n][1]))
            copies[n].grad = g.clone()
        with CollectiveBytes() as counter:
            opt.step()
        moved = all_ranks_sum(sum(b for op, b in counter.bytes.items() if "alltoall" in op))
        copies_opt.step()
        norm = ref.step(grads)
        norm_errors[f"step {step}"] = abs(opt.last_grad_norm - norm) / norm
        ns.append(all_ranks_sum(opt.last_stats["ns_matrices"]))
    final = {n: p.full_tensor() for n, p in params.items()}
    if not normuon:
        checks.within(f"{name}: params vs float64 reference",
                      {n: relative_error(final[n], ref.w[n]) for n in final}, TOLERANCE)
    # DMuon sums squares of float32 gradients, each element once: ≤ n·u relative for n entries (γ_n).
    checks.within(f"{name}: DMuon's global gradient norm", norm_errors,
                  max(math.prod(s) for s in shapes.values()) * U_F32)
    differ = [n for n in final if not torch.equal(final[n], copies[n].detach())]
    checks.report(f"{name}: vs DMuon on replicated copies", not differ,
                  f"{len(differ)} of {len(final)} tensors differ in bits" + (f" (first {differ[0]})" if differ else ""))
    if normuon:
        return
    pieces = exchanged_elements(opt)
    muon_bytes = 4 * sum(math.prod(s) for n, s in shapes.items() if is_muon(n, s))
    checks.report(f"{name}: step() moves each piece once", moved == 2 * 4 * pieces,
                  f"all-to-all bytes per step, sent + received over all ranks: {moved:.0f}, expected {2 * 4 * pieces} "
                  f"({moved / 2 / muon_bytes:.2f}x the Muon matrices' float32 bytes)")
    expected = matrix_count(shapes)
    checks.report(f"{name}: Newton-Schulz once per matrix", all(c == expected for c in ns),
                  f"matrices per step summed over ranks {sorted(set(ns))}, expected {expected}")


def exchanged_elements(opt):
    """Elements step()'s all-to-alls move when every piece of U crosses once (ranks of the owner's replica
    to the owner) and every piece of O once (owner to each other holder)."""
    return sum(p.count for k in opt._matrices for g, p in enumerate(k.pieces)
               if g != k.owner and (k.replica_of(g) == k.replica_of(k.owner))) \
        + sum(p.count for k in opt._matrices for g, p in enumerate(k.pieces) if g != k.owner)


# ---- a model under parallelize_module (and fully_shard) ----

D, HIDDEN = 16, 22


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.up = torch.nn.Linear(D, HIDDEN)                 # (22, 16): column-wise TP, Shard(0)
        self.down = torch.nn.Linear(HIDDEN, D, bias=False)   # (16, 22): row-wise TP, Shard(1)

    def forward(self, x):                                    # x (B, D)
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def mlp_case():
    """(model, its base module, its tensor-parallel plan, its blocks, loss(model, batch), None: check_model lays
    it out)."""
    torch.manual_seed(3)
    model = MLP()
    plan = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}

    def loss(m, batch):
        x, y = batch
        return F.mse_loss(m(x), y)
    return model, model, plan, model.blocks, loss, None


def mlp_batch(gen):
    return torch.randn(BATCH, D, generator=gen), torch.randn(BATCH, D, generator=gen)


# Hugging Face's own distributed layout at 4 ranks: its DistributedConfig's dense mesh (fsdp 2, tp 2) and expert
# mesh (efsdp 2, ep 2), efsdp = fsdp · tp / ep; experts exchange tokens by all-to-all (AllToAllEP).
HF_MOE_LAYOUT = dict(fsdp_size=2, tp_size=2, ep_size=2, ep_implementation="all_to_all")


# Without TP, for both modes: fsdp 4, experts on ep 2 x efsdp 2.
HF_MOE_EP_LAYOUT = dict(fsdp_size=4, ep_size=2, ep_implementation="all_to_all")


class Holdings:
    """Several hold_on_owners calls on one model as one HeldMatrices for check_model: params, unshard()."""

    def __init__(self, *held):
        self.held = held

    @property
    def params(self):
        return set().union(*(h.params for h in self.held))

    @contextlib.contextmanager
    def unshard(self):
        with contextlib.ExitStack() as stack:
            for h in self.held:
                stack.enter_context(h.unshard())
            yield self


def qwen3_moe_case(distributed):
    """Hugging Face transformers' Qwen3-MoE from a small config (random init, nothing downloaded: 2 layers of
    4 experts, top 2), laid out by transformers itself: DistributedConfig(**distributed) through the model's
    own prepare_distribute_model / maybe_distribute_model, which from_pretrained(distributed_config=...) calls
    between init and weight loading, with the model's base_model_tp_plan (attention column- and row-wise,
    q/k norms replicated), base_model_ep_plan (grouped_gemm: each expert stack Shard(0) over "ep";
    ep_dispatch_experts) and FSDP2 plan (fully_shard of each layer and the model on "fsdp", of each experts
    module on "efsdp", which strides its Shard(0) over the EP slice: every expert whole on one rank).
    Owner-held (no TP): transformers' EP plan by its apply_expert_parallelism, the expert stacks held on
    the EP groups (hold_on_owners over "efsdp"), the other Muon matrices held over "fsdp" (a second call),
    then fully_shard of each layer and the model on "fsdp" by hand (transformers' own FSDP2 pass takes no
    ignored_params)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.distributed import DistributedConfig

    torch.manual_seed(3)
    config = Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=44, moe_intermediate_size=12,
                            num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                            tie_word_embeddings=False, attn_implementation="eager")
    model = Qwen3MoeForCausalLM(config).train()

    def parallelize(m, held):
        layout, _, meshes = Qwen3MoeForCausalLM.prepare_distribute_model(DistributedConfig(**distributed))
        name = (f"fsdp2 (fsdp {layout.fsdp_size}) x tp {layout.tp_size}, experts ep {layout.ep_size} x efsdp "
                f"{layout.efsdp_size}")
        dp_rank = meshes.get_mesh(("fsdp", "tp")).get_local_rank("fsdp")
        if not held:
            Qwen3MoeForCausalLM.maybe_distribute_model(m, layout, meshes)
            return name, layout.dp_size, dp_rank, None
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        _, ep_plan, _ = m._resolve_parallel_plans(layout)  # the model's base_model_ep_plan, layer by layer
        apply_expert_parallelism(m, meshes.get_mesh("ep"), meshes.get_mesh("tp"), ep_plan, layout.ep_implementation)
        # Each expert stack's EP slice held on the owner's EP group (its tokens come from all dp_size batches),
        # in a call of its own; the other Muon matrices in a second call, over the dense mesh.
        dense = meshes.get_mesh("fsdp")
        muon = {n for g in module_groups(m) if g["use_muon"] for n, _ in g["params"]}
        holding = Holdings(hold_on_owners(m, meshes.get_mesh("efsdp"), predicate=lambda n, p: "experts" in n,
                                          gradient_divide_factor=layout.dp_size),
                           hold_on_owners(m, dense, predicate=lambda n, p: n in muon and "experts" not in n))
        for layer in m.model.layers:
            fully_shard(layer, mesh=dense, ignored_params=holding.params)
        fully_shard(m, mesh=dense, ignored_params=holding.params)
        return name + " (expert stacks held on EP groups, the rest on fsdp)", layout.dp_size, dp_rank, holding

    def loss(m, tokens):
        return m(input_ids=tokens, labels=tokens).loss
    return model, None, None, None, loss, parallelize


def check_model(checks, world, case_name, case, make_batch, held=False, steps=STEPS):
    """`steps` steps of a model under its TP plan (and fully_shard on "dp" at 4 ranks), DMuon(model) against
    the float64 reference fed the gathered gradients, with DMuon's routing (params.py) for Muon and AdamW.
    held: the owner-centric mode, hold_on_owners before fully_shard (each TP slice held on the owner's TP
    group); the last step's collectives go to a ledger. A case whose parallelize is not None lays its model out
    itself (Hugging Face's own plans). Returns forward + backward's bytes."""
    model, base, plan, blocks, loss, parallelize = case()
    initial = {n: t.detach().clone() for n, t in model.named_parameters()}
    layout, dp, dp_rank, holding = (tp_and_fsdp2(world, model, base, plan, blocks, held) if parallelize is None
                                    else parallelize(model, held))
    name = f"{case_name} {layout}" + (" owner-held" if held else "")
    params = dict(model.named_parameters())
    held_at = {n: p._dmuon_held.holdings for n, p in params.items() if getattr(p, "_dmuon_held", None) is not None}
    opt = DMuon(model, **HYPER)
    muon = [n for g in opt.param_groups if g["use_muon"] for n in g["param_names"]]
    ref = Reference.of_muon_names(initial, muon, HYPER, "match_rms_adamw")
    placements = sorted({str(tuple(p.placements)) for p in params.values() if isinstance(p, DTensor)})
    ledger, norm_errors = Ledger(), {}
    for step in range(steps):
        batch = make_batch(torch.Generator().manual_seed(200 + step))
        part = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
        with recording(ledger):
            ledger.label = ("forward and backward", step)
            loss(model, [t[part] for t in batch] if isinstance(batch, tuple) else batch[part]).backward()
            ledger.label = None
        grads = {n: full_of(p.grad, held_at.get(n)) for n, p in params.items()}
        first_grads = grads if step == 0 else first_grads
        norm = ref.step(grads)
        clipped = float(clip_grad_norm_(model.parameters(), 1e9))  # a norm far above it: nothing changes
        with recording(ledger):
            ledger.label = ("step", step)
            opt.step()
            ledger.label = None
        norm_errors[f"step {step}"] = max(abs(clipped - norm), abs(opt.last_grad_norm - norm)) / norm
        opt.zero_grad(set_to_none=True)
    if held:
        with holding.unshard():  # every held matrix present on every rank: its working DTensor
            final = {n: full_of(p, None) for n, p in model.named_parameters()}
    else:
        final = {n: full_of(p, None) for n, p in params.items()}
    checks.within(f"{name}: params vs float64 reference ({len(muon)} Muon matrices; {', '.join(placements)})",
                  {n: relative_error(final[n], ref.w[n]) for n in final}, TOLERANCE)
    if held:
        check_held_state_dicts(checks, name, model, holding, final)
    # dmuon.torch.clip_grad_norm_ and DMuon sum squares of float32 gradients, each element once: ≤ n·u relative.
    checks.within(f"{name}: global gradient norm (clip_grad_norm_, DMuon)", norm_errors,
                  sum(math.prod(p.shape) for p in params.values()) * U_F32)
    last = steps - 1
    moved = all_ranks_sum(sum(r["wire"] for r in ledger.under(("step", last)) if r["op"] == "all_to_all_single"))
    fwd_bwd = all_ranks_sum(ledger.wire(("forward and backward", last)))
    step_bytes = all_ranks_sum(ledger.wire(("step", last)))
    expected = 4 * exchanged_elements(opt)  # float32 pieces of U and O, each byte sent once
    muon_bytes = 4 * sum(math.prod(params[n].shape) for n in muon)
    checks.report(f"{name}: step() moves each piece once", moved == expected,
                  f"per step over all ranks: forward+backward {fwd_bwd:.0f} B (torch.distributed's collectives: "
                  f"FSDP2's or the held hooks'; TP's own are DTensor's), step() {step_bytes:.0f} B of which all-to-all "
                  f"{moved:.0f}, expected {expected} ({moved / muon_bytes:.2f}x the Muon matrices' float32 bytes)")
    stacks = [k for k in opt._matrices if k.expert is not None]
    if stacks:  # experts each whole on one rank (the layouts here) stay there: owned by it, no byte of theirs moves
        alone = [k for k in stacks if sum(1 for p in k.pieces if p.count) == 1 and k.holders()]
        moving = [k.name for k in alone if k.u_travels or k.o_travels]
        checks.report(f"{name}: experts whole on one rank move nothing", alone == stacks and not moving,
                      f"{len(alone)} of {len(stacks)} experts whole on one rank, {len(moving)} of them moving"
                      + (f" (first {moving[0]})" if moving else ""))
    return fwd_bwd, first_grads


def check_held_state_dicts(checks, name, model, holding, final):
    """A model with held TP slices: its full state dict (get_model_state_dict, full_state_dict=True) equals
    the weights bit for bit; a DCP save, every held slice zeroed, a DCP load and load_state_dict give them
    back bit for bit."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    differ = [n for n in final if not torch.equal(full[n], final[n])]
    checks.report(f"{name}: full state dict", not differ,
                  f"{len(differ)} of {len(final)} tensors differ in bits" + (f" (first {differ[0]})" if differ else ""))
    box = [tempfile.mkdtemp(prefix="dmuon_tp_dcp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    dcp.save(model.state_dict(), checkpoint_id=box[0])
    with torch.no_grad():
        for p in holding.params:
            (p.to_local() if isinstance(p, DTensor) else p).zero_()  # a placeholder skips it: the keepers' are zeroed
    state = model.state_dict()
    dcp.load(state, checkpoint_id=box[0])
    model.load_state_dict(state)
    with holding.unshard():
        loaded = {n: full_of(p, None) for n, p in model.named_parameters()}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(box[0], ignore_errors=True)
    differ = [n for n in final if not torch.equal(loaded[n], final[n])]
    checks.report(f"{name}: DCP save, held slices zeroed, DCP load", not differ,
                  f"{len(differ)} of {len(final)} tensors differ in bits" + (f" (first {differ[0]})" if differ else ""))


def check_model_modes(checks, world, case_name, case, make_batch):
    """check_model in the all-to-all mode and, where held matrices take the layout, the owner-held mode:
    its forward and backward move no more than FSDP2's in the all-to-all mode (AdamW's, with the same
    parallelism: the optimizer changes nothing there) + 5% (the ledger test's bound)."""
    a2a, _ = check_model(checks, world, case_name, case, make_batch)
    held, _ = check_model(checks, world, case_name, case, make_batch, held=True)
    checks.report(f"{case_name} owner-held: forward+backward bytes within FSDP2's", held <= 1.05 * a2a,
                  f"{held:.0f} B against {a2a:.0f} B per step over all ranks")


def check_held_tp_habits(checks):
    """The owner-held mode under FSDP2 × TP (2 × 2, the MLP) with what training scripts do
    (torch_owner_held_habits_test's, under FSDP2 alone):
      meta init  with torch.device("meta"), parallelize_module, hold_on_owners, fully_shard, to_empty (which
                 swaps a DTensor parameter's contents, torch.utils.swap_tensors), DMuon(model), then every
                 parameter written from its global value (each rank its part; a placeholder skips the write):
                 every held slice equals the values bit for bit, each rank's masters are the bytes it owns;
      bf16       MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) from fully_shard reaches the
                 held slices: float32 masters and momentum on the keepers, bfloat16 working copies; STEPS
                 steps equal the all-to-all mode's under the same policy bit for bit (the same bfloat16
                 weights in forward and backward, the float32 gradient sums of 2 ranks, the same updates)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}
    torch.manual_seed(3)
    values = {n: t.detach().clone() for n, t in MLP().named_parameters()}

    def build(device, held, mp_policy=MixedPrecisionPolicy()):
        """(model, HeldMatrices or None, DMuon) with `values` written after the optimizer is built."""
        with torch.device(device):
            model = MLP()
        parallelize_module(model, mesh["tp"], plan)
        holding = hold_on_owners(model, mesh["dp"]) if held else None
        ignored = holding.params if held else None
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"], ignored_params=ignored, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh["dp"], ignored_params=ignored, mp_policy=mp_policy)
        if device == "meta":
            model.to_empty(device="cpu")
        opt = DMuon(model, **HYPER)  # as a script does after to_empty: the held parameters get their marks back
        with torch.no_grad():  # each rank writes its part of every value (a placeholder skips the write)
            for n, p in model.named_parameters():
                p.copy_(distribute(values[n], p.device_mesh, p.placements))
        return model, holding, opt

    model, holding, _ = build("meta", True)
    params = dict(model.named_parameters())
    marked = [n for n in holding.names if getattr(params[n], "_dmuon_held", None) is not None]
    slices = {n: full_of(params[n], params[n]._dmuon_held.holdings) for n in marked}
    differ = [n for n in marked if not torch.equal(slices[n], values[n])]
    masters = sum(p.to_local().numel() * p.element_size() for n, p in params.items()
                  if n in holding.owners and not isinstance(p.to_local(), HeldElsewhere))
    mine = holding.owned_bytes[dist.get_rank()]
    checks.report("mlp fsdp2 x tp owner-held: meta init", len(marked) == len(holding.names) and not differ
                  and masters == mine, f"{len(marked)} of {len(holding.names)} held matrices marked after to_empty, "
                  f"{len(differ)} differ from the values in bits; {masters} bytes of held masters here, the rank "
                  f"owns {mine}")

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    finals = []
    for held in (False, True):
        model, holding, opt = build("cpu", held, policy)
        dp_rank = mesh.get_local_rank("dp")
        for step in range(STEPS):
            x, y = mlp_batch(torch.Generator().manual_seed(200 + step))
            rows = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
            F.mse_loss(model(x[rows]), y[rows]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if held:
            keepers = [p for n, p in model.named_parameters()
                       if n in holding.owners and not isinstance(p.to_local(), HeldElsewhere)]
            dtypes = {(p.dtype, opt.state[p]["momentum_buffer"].dtype) for p in keepers}
            working = {b.flat.dtype for u in holding._schedule.units for b in u.buckets if b.flat is not None}
            checks.report("mlp fsdp2 x tp owner-held bf16: dtypes", dtypes == {(torch.float32, torch.float32)}
                          and working == {torch.bfloat16}, f"masters and momentum {sorted(map(str, dtypes))}, "
                          f"working copies {sorted(map(str, working))}")
        # the masters (unshard() would give the held matrices' bfloat16 working copies)
        finals.append({n: full_of(p, p._dmuon_held.holdings if held and n in holding.owners else None)
                       for n, p in model.named_parameters()})
    differ = [n for n in finals[0] if not torch.equal(finals[0][n], finals[1][n])]
    checks.report("mlp fsdp2 x tp owner-held bf16: vs the all-to-all mode", not differ,
                  f"{len(differ)} of {len(finals[0])} tensors differ in bits after {STEPS} steps"
                  + (f" (first {differ[0]})" if differ else ""))


def check_moe_modes(checks, world):
    """Qwen3-MoE under EP × EFSDP in both modes (check_model, 3 steps each), and the owner-held expert stacks'
    gradients at the first step bit for bit FSDP2's in the all-to-all mode: the same local gradients, summed
    over the 2 ranks of an expert's efsdp group (a + b either way) and divided by the 4 data-parallel batches
    (exact), not by the group's 2 ranks (hold_on_owners's gradient_divide_factor)."""
    case = functools.partial(qwen3_moe_case, HF_MOE_EP_LAYOUT)
    _, a2a = check_model(checks, world, "hf qwen3-moe", case, qwen2_batch, False, 3)
    _, held = check_model(checks, world, "hf qwen3-moe", case, qwen2_batch, True, 3)
    stacks = [n for n in held if "experts" in n]
    differ = [n for n in stacks if not torch.equal(held[n], a2a[n])]
    checks.report("hf qwen3-moe owner-held: expert gradients at step 0 vs FSDP2's", stacks and not differ,
                  f"{len(differ)} of {len(stacks)} expert stacks' gradients differ in bits"
                  + (f" (first {differ[0]}: ratio of norms {float(held[differ[0]].norm() / a2a[differ[0]].norm()):.3f})"
                     if differ else ""))


# ---- pipeline stages: one DMuon per stage ----

def check_pipeline(checks):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, stage_mesh = mesh.get_local_rank("pp"), mesh["dp"]
    shapes = {f"stage{stage}.w": (13 + stage, 9), f"stage{stage}.v": (9, 13), f"stage{stage}.norm": (9,)}
    initial = full_values(shapes, seed=20 + stage)
    params = {n: torch.nn.Parameter(distribute_tensor(initial[n], stage_mesh, [Shard(0)])) for n in shapes}
    opt = DMuon(list(params.items()), process_group=stage_mesh.get_group(), **HYPER)
    ref = Reference.of_muon_names(initial, [n for n in shapes if is_muon(n, shapes[n])], HYPER, "match_rms_adamw")
    for step in range(STEPS):
        grads = full_values(shapes, seed=30 + 10 * stage + step)
        for n, g in grads.items():
            params[n].grad = distribute_tensor(g, stage_mesh, [Shard(0)])
        opt.step()
        ref.step(grads)
    checks.within(f"pipeline stage {stage} (ranks {stage_mesh.mesh.tolist()}): params vs float64 reference",
                  {n: relative_error(p.full_tensor(), ref.w[n]) for n, p in params.items()}, TOLERANCE)


# ---- refusals ----

def check_refusals(checks):
    mesh = init_device_mesh("cpu", (2,))
    conv = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6, 3), mesh, [Shard(1)]))
    expect_same_error(checks, "refusal: conv filter sharded on input channels",
                      lambda: DMuon([("blocks.0.conv.weight", conv)]), [0, 1], "'blocks.0.conv.weight'", "Shard(dim=1)")
    partial = torch.nn.Parameter(DTensor.from_local(torch.randn(4, 4), mesh, [Partial()], run_check=False))
    expect_same_error(checks, "refusal: Partial() parameter",
                      lambda: DMuon([("blocks.0.w", partial)]), [0, 1], "'blocks.0.w'", "Partial")
    # What the owner-centric mode cannot hold under tensor parallelism, refused at hold_on_owners with the reason.
    half = Block()
    parallelize_module(half, mesh, {"up": ColwiseParallel()})
    expect_same_error(checks, "refusal: owner-held TP slices beside a matrix TP leaves whole",
                      lambda: hold_on_owners(half), [0, 1], "'down.weight'", "left whole by tensor parallelism")
    replicated = Block()
    replicated.up.weight = torch.nn.Parameter(distribute_tensor(replicated.up.weight.detach(), mesh, [Replicate()]))
    replicated.down.weight = torch.nn.Parameter(distribute_tensor(replicated.down.weight.detach(), mesh, [Shard(1)]))
    expect_same_error(checks, "refusal: owner-held matrix replicated over TP",
                      lambda: hold_on_owners(replicated), [0, 1], "'up.weight'", "Replicate()", "once per TP rank")
    moe = torch.nn.Module()  # split within its experts (Shard(1)): not whole experts per EP rank
    moe.experts = torch.nn.Module()
    moe.experts.w1 = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6, 5), mesh, [Shard(1)]))
    expect_same_error(checks, "refusal: owner-held expert stack split within its experts",
                      lambda: hold_on_owners(moe), [0, 1], "'experts.w1'", "(4, 6, 5)", "Shard(dim=1)",
                      "all-to-all mode")
    conv = torch.nn.Module()
    conv.weight = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6, 3), mesh, [Shard(0)]))
    expect_same_error(checks, "refusal: owner-held conv filter under tensor parallelism",
                      lambda: hold_on_owners(conv, predicate=lambda n, p: True), [0, 1], "'weight'", "(4, 6, 3)",
                      "all-to-all mode")
    sharded = Block()
    fully_shard(sharded, mesh=mesh)
    expect_same_error(checks, "refusal: hold_on_owners after fully_shard",
                      lambda: hold_on_owners(sharded, mesh), [0, 1], "'up.weight'", "before fully_shard")


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world not in (2, 4, 8):
        raise SystemExit(f"torch_tp_ep_test runs at 2, 4 or 8 ranks, not {world}")
    checks = Checks(rank, world, "torch_tp_ep_test")
    for name, mesh_shape, dim_names, spec in layouts(world):
        checks.run(name, check_layout, checks, name, mesh_shape, dim_names, spec)
        checks.run(f"{name}, normuon", check_layout, checks, f"{name}, normuon", mesh_shape, dim_names, spec,
                   dict(HYPER, variant="normuon"))
    checks.run("model", check_model_modes, checks, world, "mlp", mlp_case, mlp_batch)
    if world < 8:
        checks.run("qwen2", check_model_modes, checks, world, "hf qwen2", qwen2_case, qwen2_batch)
    if world == 4:
        checks.run("qwen3-moe", check_model, checks, world, "hf qwen3-moe", lambda: qwen3_moe_case(HF_MOE_LAYOUT),
                   qwen2_batch, False, 3)
        checks.run("qwen3-moe held", check_moe_modes, checks, world)
        checks.run("owner-held habits under tp", check_held_tp_habits, checks)
        checks.run("pipeline", check_pipeline, checks)
    if world == 2:
        checks.run("refusals", check_refusals, checks)
    failures.extend(checks.failed)
    return finish(f"torch_tp_ep_test np{world}")

if __name__ == "__main__":
    exit_rank(main())
