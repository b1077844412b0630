"""dmuon.torch.DMuon against a float64 single-process Muon + AdamW written here from DESIGN section 1.

Run under `torchrun --standalone --nproc_per_node N tests/python/torch_dmuon_mpi_test.py` or
`mpirun -np N python tests/python/torch_dmuon_mpi_test.py` (N = 1..4, gloo). One launch runs every
check (python + torch start-up costs seconds per launch):
  replicated   named_parameters(), milp owners, clipping, weight decay, StepLR halving lr at step 5
  sharded      dim-0 chunks (Sharded), two param groups with different lrs (one without nesterov),
               lpt owners, "original" scale
  mixed        replicated and sharded parameters in one optimizer, rr owners
  resume       torch.save of every rank's (local) state_dict after 5 of 10 steps, loaded into a new
               optimizer: the next 5 steps are bit-identical to the uninterrupted run
  owners       9 + 5 same-shape matrices (more than ranks) with rr owners, plain and under FSDP2: the
               owners DMuon holds are the plan, each rank runs its planned share of Newton–Schulz in
               every step (several matrices of one bucket on every rank), the weights the reference's
  fsdp2        real fully_shard on a 1-D mesh; gradients from FSDP2's reduce-scatter; also with
               MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32) and CPUOffloadPolicy
  hsdp         fully_shard on a (2, N/2) mesh (N even): replicas bit-identical, every Muon matrix
               orthogonalized exactly once in the whole job
  experts      an (8, 24, 16) stack sharded by experts under FSDP2 moves nothing (no collective);
               under HSDP only O travels (one collective)
  bfloat16     bf16 parameters with float32 state near the float32 run; 50 steps of bf16 parameters
               with float32 and with bf16 state against float64 (the state's drift, printed); the
               Newton–Schulz of bf16 U (state_dtype=None) within bf16 rounding of float64
  errors       parameter lists that differ across ranks, a wrong local shard, a device without a
               backend, unsupported DTensor placements, a permuted or foreign mesh, non-finite
               gradients ("error" and "skip"): the same error on every rank
Owners come from the milp balancer in "replicated" and from lpt or rr elsewhere (milp's time limit
would dominate the run time).
The model mixes shapes: a 7-row matrix (rows not divisible by 2, 3 or 4), a 3-row one (fewer rows
than ranks at N = 4: an empty shard), a 4-D conv weight, two of one shape (a batch), an (8, 24, 16)
expert stack (8 matrices of 24×16, each its own Newton–Schulz), 1-D parameters, and an embedding and
a head that go to AdamW by name. Each tensor must be within 1e-5 (relative Frobenius) of the
reference after 10 steps.
"""

import io

import torch
import torch.distributed as dist

import dmuon
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dmuon.torch import DMuon
from dmuon.torch.mpirun import init_process_group
from hand_sharded_model import (SPECS, STEPS, TOLERANCE, Holder, Model, gather_dim0, gradient, gradients,
                                initial_values)
from muon_reference import Reference, hyper_of, muon_matrices, newton_schulz_ref
from rank_exit import exit_rank
from rank_checks import check, finish

def run(model, opt, steps, first_step=0, ref=None, sched=None):
    for step in range(first_step, first_step + steps):
        grads = gradients(step)
        if ref is not None:
            ref.hyper = hyper_of(opt)  # the lrs the scheduler set for this step
            ref.step(grads)
        model.set_grads(grads)
        opt.step()
        if sched is not None:
            sched.step()


def compare(label, model, ref, names=None):
    worst = 0.0
    for name in names or list(ref.w):
        full = model.full(name).double()
        err = float((full - ref.w[name]).norm() / ref.w[name].norm())
        worst = max(worst, err)
        check(err <= TOLERANCE, f"{label}: {name} relative error {err:.2e} > {TOLERANCE:.0e}")
    return worst


def same_on_every_rank(label, value, group=None):
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    check(all(v == values[0] for v in values), f"{label}: differs across ranks: {values}")


def total_over_ranks(value):
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t)


# ---- the checks ----

MUON_NAMES = [n for n, s in SPECS if len(s) >= 2 and n not in ("embed.weight", "head.weight")]
MUON_MATRICES = [f"{n}[{e}]" for n in MUON_NAMES for e in range(dict(SPECS)[n][0])
                 if len(dict(SPECS)[n]) == 3] + [n for n in MUON_NAMES if len(dict(SPECS)[n]) != 3]


def check_replicated():
    values = initial_values()
    model = Model(values)
    opt = DMuon(model.named(), weight_decay=0.01, adamw_weight_decay=0.1, clip_grad_norm=20.0, balancer="milp",
                ns_dtype="float32")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    check(sorted(opt.owners) == sorted(MUON_MATRICES), f"replicated: Muon matrices {sorted(opt.owners)}")
    ref = Reference(values, {}, clip=20.0)
    run(model, opt, STEPS, ref=ref, sched=sched)
    check(opt.last_grad_norm > 20.0, f"replicated: clipping never active (norm {opt.last_grad_norm})")
    worst = compare("replicated", model, ref)
    for name, p in model.params.items():  # every rank applies the same updates: equal bits
        parts = [torch.empty_like(p) for _ in range(WORLD)]
        dist.all_gather(parts, p.detach())
        check(all(torch.equal(parts[0], q) for q in parts), f"replicated: {name} differs across ranks")
    check(total_over_ranks(opt.last_stats["ns_matrices"]) == len(MUON_MATRICES),
          "replicated: Muon matrices not orthogonalized exactly once")
    return worst


def two_groups(model):
    names = [n for n, _ in SPECS]
    return [{"params": model.named(names[:6]), "lr": 0.02, "adamw_lr": 2e-3},
            {"params": model.named(names[6:]), "lr": 0.01, "nesterov": False, "adamw_lr": 1e-3,
             "adamw_betas": (0.8, 0.9)}]


def check_sharded():
    values = initial_values()
    model = Model(values, sharded_names=[n for n, _ in SPECS])
    opt = DMuon(two_groups(model), scale="original", balancer="lpt", ns_dtype="float32")
    check(len(opt.param_groups) == 4, f"sharded: {len(opt.param_groups)} param groups, expected 4")
    ref = Reference(values, {}, scale="original")
    run(model, opt, STEPS, ref=ref)
    check(total_over_ranks(opt.last_stats["ns_matrices"]) == len(MUON_MATRICES),
          "sharded: Muon matrices not orthogonalized exactly once")
    return compare("sharded", model, ref)


MIXED_SHARDED = ["embed.weight", "layers.0.attn.weight", "layers.0.mlp.up.weight", "odd.weight", "tiny.weight",
                 "experts.weight", "layers.0.mlp.up.bias"]


def mixed_optimizer(model):
    return DMuon(model.named(), balancer="rr", clip_grad_norm=30.0, weight_decay=0.05, ns_dtype="float32")


def check_mixed_and_resume():
    values = initial_values()
    straight = Model(values, MIXED_SHARDED)
    opt = mixed_optimizer(straight)
    ref = Reference(values, {}, clip=30.0)
    run(straight, opt, STEPS, ref=ref)
    worst = compare("mixed", straight, ref)

    first = Model(values, MIXED_SHARDED)
    opt1 = mixed_optimizer(first)
    run(first, opt1, STEPS // 2)
    buffer = io.BytesIO()
    torch.save(opt1.state_dict(), buffer)  # this rank's state: the resumed run has the same ranks
    halfway = {n: first.full(n) for n, _ in SPECS}
    resumed = Model(halfway, MIXED_SHARDED)
    opt2 = mixed_optimizer(resumed)
    buffer.seek(0)
    opt2.load_state_dict(torch.load(buffer))
    check(opt2.updates == STEPS // 2, f"resume: {opt2.updates} updates after loading, expected {STEPS // 2}")
    run(resumed, opt2, STEPS - STEPS // 2, first_step=STEPS // 2)
    for name, _ in SPECS:
        check(torch.equal(resumed.params[name], straight.params[name]), f"resume: {name} not bit-identical")
    check(opt2.updates == STEPS, f"resume: {opt2.updates} updates after the resumed run, expected {STEPS}")
    return worst


# Ownership-dependent paths at every world size: more same-shape matrices than ranks (9 of 10×12, 5 of
# 12×6) under rr, so every rank of 1..4 owns several matrices of one bucket, whose U arrive from several
# ranks and whose O leave to several. Rows 10 split unevenly over 3 and 4 ranks (and 1 row at 4).
OWNED_SPECS = ([(f"blocks.{i}.weight", (10, 12)) for i in range(9)] + [(f"proj.{i}.weight", (12, 6)) for i in range(5)]
               + [("blocks.norm.weight", (12,))])
OWNED_STEPS = 4


def check_planned_owners(label, opt, matrices):
    """The owners DMuon holds are the planner's (rr, deterministic: planned again here) for `matrices`
    [(name, rows, cols)], and this rank owns several of the first bucket; returns this rank's share."""
    planned = dmuon.plan_owners([(r, c) for _, r, c in matrices], WORLD, balancer="rr")[0]
    check(opt.owners == {n: o for (n, _, _), o in zip(matrices, planned)},
          f"{label}: owners {opt.owners}, planned {planned}")
    first = [o for (_, r, c), o in zip(matrices, planned) if (r, c) == matrices[0][1:]]
    check(first.count(RANK) >= 2, f"{label}: rank {RANK} owns {first.count(RANK)} of the first bucket, wanted >= 2")
    return planned.count(RANK)


def check_ownership(label, fsdp2):
    """OWNED_SPECS with rr owners, plain (every other parameter in dim-0 chunks, the rest whole) or
    under FSDP2: the owners are the plan, each rank runs its planned share of Newton–Schulz in every
    step, and the weights follow the float64 reference."""
    gen = torch.Generator().manual_seed(11)
    values = {n: torch.randn(shape, generator=gen) * 0.5 for n, shape in OWNED_SPECS}
    if fsdp2:
        model = Holder(values, [n for n, _ in OWNED_SPECS])
        fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    else:
        model = Model(values, [n for k, (n, _) in enumerate(OWNED_SPECS) if k % 2 == 0], specs=OWNED_SPECS)
    opt = DMuon(model.named(), balancer="rr", weight_decay=0.02, ns_dtype="float32")
    share = check_planned_owners(label, opt, [(n, *shape) for n, shape in OWNED_SPECS if len(shape) == 2])
    ref = Reference(values, hyper_of(opt))
    for step in range(OWNED_STEPS):
        grads = {n: gradient(step, k, shape) for k, (n, shape) in enumerate(OWNED_SPECS)}
        ref.step(grads)
        if fsdp2:
            model(grads).backward()
        else:
            model.set_grads(grads)
        opt.step()
        opt.zero_grad()
        check(opt.last_stats["ns_matrices"] == share, f"{label}: rank {RANK} ran Newton–Schulz on "
              f"{opt.last_stats['ns_matrices']} matrices at step {step + 1}, its planned share is {share}")
    return compare(label, model, ref)


def hsdp_mesh():
    return init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))


def check_fsdp2(label, mesh, **policies):
    """fully_shard on `mesh` (1-D: FSDP2, 2-D: HSDP) with `policies` (mp_policy, offload_policy)
    against the reference; on a 2-D mesh, replicas must hold equal bits. With a bf16 param_dtype the
    forward runs on bf16 copies, so backward gives the gradient rounded to bf16 (then reduced in
    float32): the reference is fed exactly that, and the optimizer still sees float32 shards."""
    values = initial_values()
    model = Holder(values, [n for n, _ in SPECS])
    fully_shard(model, mesh=mesh, **policies)
    opt = DMuon(model.named(), weight_decay=0.01, clip_grad_norm=25.0, balancer="lpt", ns_dtype="float32")
    for name, p in model.named():
        check(p.dtype == torch.float32 and p.to_local().device.type == "cpu",
              f"{label}: FSDP2 gives the optimizer {name} as {p.dtype} on {p.to_local().device}")
    ref = Reference(values, hyper_of(opt), clip=25.0)
    mp = policies.get("mp_policy")
    for step in range(STEPS):
        grads = gradients(step)
        if mp is not None:
            grads = {n: g.to(mp.param_dtype).float() for n, g in grads.items()}
        ref.step(grads)
        model.train_step(opt, step)
    check(total_over_ranks(opt.last_stats["ns_matrices"]) == len(MUON_MATRICES),
          f"{label}: {total_over_ranks(opt.last_stats['ns_matrices'])} Newton–Schulz runs for "
          f"{len(MUON_MATRICES)} Muon matrices")
    if mesh.ndim == 2:
        for name, p in model.named():
            local = p.to_local().detach()
            parts = [None] * WORLD
            dist.all_gather_object(parts, (mesh.get_local_rank(1), local))
            for shard, t in parts:
                if shard == mesh.get_local_rank(1):
                    check(torch.equal(t, local), f"{label}: replicas of {name} differ")
    return compare(label, model, ref)


def check_experts_stay_local(label, mesh):
    """An expert stack sharded by experts: each expert's owner holds it, so U never travels; with
    one replica nothing travels (no collective), with more only O does (one per step)."""
    values = initial_values()
    model = Holder(values, ["experts.weight"])
    fully_shard(model, mesh=mesh)
    opt = DMuon(model.named(), balancer="lpt", ns_dtype="float32")
    calls = []
    all_to_all = opt.comm.all_to_all
    opt.comm.all_to_all = lambda *args, **kwargs: calls.append(1) or all_to_all(*args, **kwargs)
    ref = Reference(values, hyper_of(opt))
    for step in range(3):
        ref.step({"experts.weight": gradients(step)["experts.weight"]})
        model.train_step(opt, step)
    replicas = mesh.size(0) if mesh.ndim == 2 else 1
    expected = 0 if replicas == 1 or WORLD == 1 else 3
    check(len(calls) == expected, f"{label}: {len(calls)} all_to_all calls in 3 steps, expected {expected}")
    return compare(label, model, ref, ["experts.weight"])


def check_replicated_dtensor():
    """A DTensor with Replicate() (every rank holds it whole) against the reference."""
    values = initial_values()
    name = "layers.0.mlp.up.weight"
    p = dtensor_param(values, name, init_device_mesh("cpu", (WORLD,)), [Replicate()])
    opt = DMuon([(name, p)], balancer="lpt", ns_dtype="float32")
    ref = Reference(values, hyper_of(opt))
    for step in range(STEPS):
        g = gradients(step)[name]
        ref.step({name: g})
        p.grad = DTensor.from_local(g.clone(), p.device_mesh, [Replicate()])
        opt.step()
    err = float((p.detach().to_local().double() - ref.w[name]).norm() / ref.w[name].norm())
    check(err <= TOLERANCE, f"replicated DTensor: relative error {err:.2e} > {TOLERANCE:.0e}")
    return err


def check_bfloat16():
    """bf16 sharded parameters with float32 state (the default) stay near the float32 run: the
    parameters round to 8 bits after each of the 3 steps, so 1e-2 relative."""
    values = initial_values()
    names = [n for n, _ in SPECS]
    f32 = Model(values, names)
    bf16 = Model({n: v.bfloat16() for n, v in values.items()}, names)
    opt32, opt16 = (DMuon(m.named(), balancer="lpt", ns_dtype="float32") for m in (f32, bf16))
    check(opt16.state[bf16.params["odd.weight"]]["momentum_buffer"].dtype == torch.float32,
          "bfloat16: momentum of a bf16 parameter is not float32")
    run(f32, opt32, 3)
    run(bf16, opt16, 3)
    for name in names:
        a, b = f32.full(name).double(), bf16.full(name).double()
        err = float((a - b).norm() / a.norm())
        check(err < 1e-2, f"bfloat16: {name} relative difference {err:.2e} to float32")


def relative(a, b):
    return float((a.double() - b).norm() / b.norm()) if b.norm() > 0 else float(a.double().norm())


def check_state_dtype_drift(steps=50):
    """`steps` steps of bf16 sharded parameters against the float64 reference fed the same bf16
    gradients. Muon's momentum and AdamW's moments depend on the gradients only, so with float32
    state (the default) they stay within the float32 tolerance of the reference (each step's
    lerp rounds by 2^-24, so 50 steps stay below 1e-5); with state_dtype=None they are bf16 and
    drift by bf16 rounding. The weights round to bf16 after every step in both runs. Returns
    {state dtype: (worst state error, worst weight error)}, printed by main."""
    names = [n for n, _ in SPECS]
    values = {n: v.bfloat16() for n, v in initial_values().items()}
    drift = {}
    for state_dtype in (torch.float32, None):
        model = Model(values, names)
        opt = DMuon(model.named(), state_dtype=state_dtype, balancer="lpt", ns_dtype="float32")
        ref = Reference(values, hyper_of(opt))
        for step in range(steps):
            grads = {n: g.bfloat16() for n, g in gradients(step).items()}
            ref.step(grads)
            model.set_grads(grads)
            opt.step()
        worst_state = worst_weight = 0.0
        for name, shape in SPECS:
            st = opt.state[model.params[name]]
            keys = {"momentum_buffer": "m"} if "momentum_buffer" in st else {"exp_avg": "m", "exp_avg_sq": "v"}
            for key, ref_key in keys.items():
                check(st[key].dtype == (state_dtype or torch.bfloat16),
                      f"state dtype {state_dtype}: {name} {key} is {st[key].dtype}")
                worst_state = max(worst_state, relative(gather_dim0(st[key], shape[0]), ref.state[name][ref_key]))
            worst_weight = max(worst_weight, relative(model.full(name), ref.w[name]))
        drift[str(state_dtype)] = (worst_state, worst_weight)
    check(drift[str(torch.float32)][0] <= TOLERANCE,
          f"state dtype: float32 state drifted {drift[str(torch.float32)][0]:.2e} from the reference in {steps} steps")
    return drift


def check_bfloat16_newton_schulz(state_dtype):
    """One step from W = 0 without Nesterov and decay gives W = −lr·s·orth(M) with M the momentum
    DMuon keeps, so O can be read back and compared with float64 Newton–Schulz of M. The engine's
    Newton–Schulz is float32 (±1e-5, capi_test), its bf16 path rounds O to bf16 (unit roundoff 2^-8);
    the update −lr·s·O is formed in float32 (2^-24) and rounded to the bf16 parameter (another 2^-8
    at most, exact when O is already bf16 and lr·s a power of two). Bound: 2·2^-8 + 1e-5."""
    bound = 2 * 2.0 ** -8 + 1e-5
    shapes = {"experts.weight": (8, 24, 16), "layers.0.mlp.down.weight": (16, 40)}
    model = Model({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}, list(shapes))
    opt = DMuon(model.named(list(shapes)), lr=2.0 ** -4, nesterov=False, scale="original",
                state_dtype=state_dtype, balancer="lpt", ns_dtype="float32")
    grads = {n: gradient(0, k, s).bfloat16() for k, (n, s) in enumerate(shapes.items())}
    model.set_grads(grads)
    opt.step()
    for name, shape in shapes.items():
        momentum = gather_dim0(opt.state[model.params[name]]["momentum_buffer"], shape[0])
        stack = muon_matrices(momentum.double())
        rows, cols = stack.shape[1], stack.shape[2]
        s = max(1.0, rows / cols) ** 0.5
        o = muon_matrices(model.full(name).double()) / (-2.0 ** -4 * s)
        for e, (m, got) in enumerate(zip(stack, o)):
            ref = newton_schulz_ref(m)
            err = float((got - ref).norm() / ref.norm())
            check(err <= bound, f"bf16 NS ({state_dtype} state): {name}[{e}] relative error {err:.2e} > {bound:.2e}")


def expect_same_error(label, make, exception, *needles, group=None):
    """make() raises `exception` with the same message, holding every needle, on every rank of group."""
    message = None
    try:
        make()
    except exception as e:
        message = str(e)
    same_on_every_rank(label, message, group)
    check(message is not None, f"{label}: no {exception.__name__} raised")
    for needle in needles:
        check(message is not None and needle in message, f"{label}: '{needle}' not in: {message}")


def dtensor_param(values, name, mesh, placements):
    """values[name] as a DTensor parameter on `mesh` with `placements` (no communication)."""
    full = values[name]
    local = full
    for dim, p in enumerate(placements):
        if isinstance(p, Shard):
            local = torch.chunk(local, mesh.size(dim), dim=p.dim)[mesh.get_local_rank(dim)]
    return torch.nn.Parameter(DTensor.from_local(local.clone(), mesh, placements, shape=full.shape,
                                                 stride=full.stride()))


def check_errors():
    values = initial_values()
    if WORLD > 1:
        odd = dict(values)
        if RANK == WORLD - 1:
            odd["odd.weight"] = torch.zeros(7, 13)
        expect_same_error("mismatch", lambda: DMuon(Model(odd).named()), ValueError,
                          "differ across ranks", f"rank {WORLD - 1}", "odd.weight")

        def wrong_shard():
            model = Model(values, ["odd.weight"])
            if RANK == 1:
                model.params["odd.weight"] = torch.nn.Parameter(torch.zeros(1, 12))
            return DMuon(model.named())
        expect_same_error("wrong shard", wrong_shard, ValueError, "odd.weight", "rank 1", "torch.chunk")

        permuted = DeviceMesh("cpu", list(reversed(range(WORLD))))
        expect_same_error("permuted mesh", lambda: DMuon([("odd.weight", dtensor_param(
            values, "odd.weight", permuted, [Shard(0)]))]), ValueError, "odd.weight",
            f"mesh ranks {list(reversed(range(WORLD)))}", "not the optimizer's process group ranks")
    if WORLD == 4:
        # The optimizer of ranks [0, 1] (and of [2, 3]) given parameters on the mesh of ranks
        # [0, 2] or [1, 3]: the same size, other ranks. Each optimizer's first rank's mesh is [0, 2].
        mesh = hsdp_mesh()
        pair = mesh.get_group("shard")
        foreign = mesh["replicate"]
        first = RANK - RANK % 2
        expect_same_error("foreign mesh", lambda: DMuon([("odd.weight", dtensor_param(
            values, "odd.weight", foreign, [Shard(0)]))], process_group=pair), ValueError, "odd.weight",
            "mesh ranks [0, 2]", f"process group ranks [{first}, {first + 1}]", group=pair)
    line = init_device_mesh("cpu", (WORLD,))
    expect_same_error("placement Partial()", lambda: DMuon([("odd.weight", dtensor_param(
        values, "odd.weight", line, [Partial()]))]), ValueError, "odd.weight", "Partial")

    def on_meta():
        model = Model(values)
        model.params["odd.weight"] = torch.nn.Parameter(torch.empty(7, 12, device="meta"))
        return DMuon(model.named())
    expect_same_error("device", on_meta, ValueError, "odd.weight", "device meta")

    bad_rank = WORLD - 1
    for policy in ("error", "skip"):
        model = Model(values, MIXED_SHARDED)
        opt = DMuon(model.named(), nonfinite=policy, balancer="lpt", ns_dtype="float32")
        grads = gradients(0)
        model.set_grads(grads)
        if RANK == bad_rank:
            model.params["layers.1.attn.weight"].grad[2, 3] = float("nan")
        before = {n: p.detach().clone() for n, p in model.params.items()}
        if policy == "error":
            expect_same_error("non-finite", opt.step, FloatingPointError, "'layers.1.attn.weight'",
                              f"rank {bad_rank}")
        else:
            opt.step()
            check(opt.skipped_steps == 1 and opt.updates == 0, f"skip: {opt.skipped_steps} skipped, {opt.updates} updates")
        for n, p in model.params.items():
            check(torch.equal(p, before[n]), f"non-finite {policy}: {n} changed")
        model.set_grads(grads)  # a finite step afterwards works
        opt.step()
        check(opt.updates == 1, f"non-finite {policy}: the next finite step did not update")


def main():
    results = {"replicated": check_replicated(), "sharded": check_sharded(), "mixed": check_mixed_and_resume(),
               "owners": check_ownership("owners", fsdp2=False),
               "owners fsdp2": check_ownership("owners fsdp2", fsdp2=True),
               "fsdp2": check_fsdp2("fsdp2", init_device_mesh("cpu", (WORLD,))),
               "experts fsdp2": check_experts_stay_local("experts fsdp2", init_device_mesh("cpu", (WORLD,))),
               "replicated DTensor": check_replicated_dtensor()}
    results["fsdp2 bf16 compute"] = check_fsdp2(
        "fsdp2 bf16 compute", init_device_mesh("cpu", (WORLD,)),
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    results["fsdp2 cpu offload"] = check_fsdp2("fsdp2 cpu offload", init_device_mesh("cpu", (WORLD,)),
                                               offload_policy=CPUOffloadPolicy(pin_memory=False))
    if WORLD % 2 == 0:
        results["hsdp"] = check_fsdp2("hsdp", hsdp_mesh())
        results["experts hsdp"] = check_experts_stay_local("experts hsdp", hsdp_mesh())
    check_bfloat16()
    drift = check_state_dtype_drift()
    check_bfloat16_newton_schulz(None)
    check_bfloat16_newton_schulz(torch.float32)
    check_errors()
    if RANK == 0:
        drifts = ", ".join(f"state {k}: state {a:.1e}, weights {b:.1e}" for k, (a, b) in drift.items())
        print(f"torch_dmuon_mpi_test np {WORLD}: bf16 parameters after 50 steps, worst relative drift from "
              f"float64: {drifts}", flush=True)
    worst = ", ".join(f"{k} {v:.1e}" for k, v in results.items())
    return finish(f"torch_dmuon_mpi_test np {WORLD}: worst relative error {worst}")


if __name__ == "__main__":
    RANK, WORLD = init_process_group("gloo")
    torch.manual_seed(0)
    exit_rank(main())
