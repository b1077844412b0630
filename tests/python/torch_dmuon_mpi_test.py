"""dmuon.torch.DMuon against a float64 single-process Muon + AdamW written here from DESIGN section 1.

Run under `mpirun -np N /usr/bin/python3 tests/python/torch_dmuon_mpi_test.py` (N = 1..4, gloo). One
launch runs every check (python + torch start-up costs seconds per launch):
  replicated   named_parameters(), milp owners, clipping, weight decay, StepLR halving lr at step 5
  sharded      dim-0 chunks (Sharded), two param groups with different lrs (one without nesterov),
               lpt owners, "original" scale
  mixed        replicated and sharded parameters in one optimizer, rr owners
  resume       state_dict after 5 of 10 steps, through torch.save/load, into a new optimizer: the
               next 5 steps are bit-identical to the uninterrupted run
  reshard      state saved by an optimizer over ranks 0..N-2, loaded at N ranks (N ≥ 2)
  bfloat16     sharded bf16 parameters (rows travel as bytes, AdamW in torch ops) near the float32 run
  errors       parameter lists that differ across ranks, a wrong local shard, a device without a
               backend, non-finite gradients ("error" and "skip"): the same error on every rank
The model mixes shapes: a 7-row matrix (rows not divisible by 2, 3 or 4), a 3-row one (fewer rows
than ranks at N = 4: an empty shard), a 4-D conv weight, two of one shape (a batch), 1-D parameters,
and an embedding and a head that go to AdamW by name. Each tensor must be within 1e-5 (relative
Frobenius) of the reference after 10 steps.
"""

import io
import math
import sys

import torch
import torch.distributed as dist

from dmuon.torch import DMuon, Sharded, chunk_rows
from dmuon.torch.mpirun import init_process_group

SPECS = [
    ("embed.weight", (50, 16)),              # AdamW by name
    ("layers.0.attn.weight", (16, 16)),
    ("layers.1.attn.weight", (16, 16)),      # same shape as the previous one: a batch of 2
    ("layers.0.mlp.up.weight", (40, 16)),
    ("layers.0.mlp.down.weight", (16, 40)),
    ("odd.weight", (7, 12)),                 # 7 rows: not divisible by 2, 3 or 4
    ("tiny.weight", (3, 20)),                # 3 rows: an empty shard at 4 ranks
    ("conv.weight", (6, 3, 2, 2)),           # Muon views it as 6×12
    ("norm.weight", (16,)),
    ("layers.0.mlp.up.bias", (40,)),
    ("head.weight", (50, 16)),               # AdamW by name
]
STEPS = 10
TOLERANCE = 1e-5
KELLER = (3.4445, -4.7750, 2.0315)

failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print(f"rank {RANK}: FAIL {what}", flush=True)


# ---- the reference (float64, one process, DESIGN 1 and 2.1) ----

def newton_schulz_ref(u, steps=5):
    x = u.double()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (x.norm() + 1e-7)
    a, b, c = KELLER
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


class Reference:
    """Muon (lerp momentum, nesterov, NS, scale, decoupled decay) + AdamW (torch.optim.AdamW), float64."""

    def __init__(self, values, hyper, clip=None, scale="match_rms_adamw"):
        self.w = {n: v.double().clone() for n, v in values.items()}
        self.hyper, self.clip, self.scale = hyper, clip, scale
        self.state = {n: {} for n in values}

    def step(self, grads):
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
        factor = self.clip / (norm + 1e-6) if self.clip and norm > self.clip else 1.0
        for name, g in grads.items():
            g = g.double() * factor
            h, st, w = self.hyper[name], self.state[name], self.w[name]
            if h["use_muon"]:
                beta = h["momentum"]
                st["m"] = beta * st.get("m", torch.zeros_like(w)) + (1 - beta) * g
                u = (1 - beta) * g + beta * st["m"] if h["nesterov"] else st["m"]
                rows, cols = w.shape[0], w.numel() // w.shape[0]
                o = newton_schulz_ref(u.reshape(rows, cols)).reshape(w.shape)
                s = max(1.0, rows / cols) ** 0.5 if self.scale == "original" else 0.2 * max(rows, cols) ** 0.5
                self.w[name] = w * (1 - h["lr"] * h["weight_decay"]) - h["lr"] * s * o
            else:
                b1, b2 = h["betas"]
                st["t"] = st.get("t", 0) + 1
                st["m"] = b1 * st.get("m", torch.zeros_like(w)) + (1 - b1) * g
                st["v"] = b2 * st.get("v", torch.zeros_like(w)) + (1 - b2) * g * g
                bias1, bias2 = 1 - b1 ** st["t"], 1 - b2 ** st["t"]
                w = w * (1 - h["lr"] * h["weight_decay"])
                self.w[name] = w - (h["lr"] / bias1) * st["m"] / (st["v"].sqrt() / math.sqrt(bias2) + h["eps"])


# ---- the model: identical values and gradients on every rank ----

def initial_values():
    gen = torch.Generator().manual_seed(7)
    return {n: torch.randn(shape, generator=gen) * 0.5 for n, shape in SPECS}


def gradient(step, k, shape):
    gen = torch.Generator().manual_seed(1000 * step + k)
    return torch.randn(shape, generator=gen) * (1 + k % 3)


def gradients(step):
    return {n: gradient(step, k, shape) for k, (n, shape) in enumerate(SPECS)}


class Model:
    """Parameters laid out per `sharded_names` (dim-0 chunks over `group`) or whole."""

    def __init__(self, values, sharded_names=(), group=None):
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.sharded = set(sharded_names)
        self.params = {}
        for name, v in values.items():
            if name in self.sharded:
                start, count = chunk_rows(v.shape[0], self.world)[self.rank]
                self.params[name] = torch.nn.Parameter(v[start:start + count].clone())
            else:
                self.params[name] = torch.nn.Parameter(v.clone())

    def named(self, names=None):
        out = []
        for name in names or [n for n, _ in SPECS]:
            p = self.params[name]
            out.append((name, Sharded(p, dict(SPECS)[name], self.group) if name in self.sharded else p))
        return out

    def set_grads(self, grads):
        for name, p in self.params.items():
            g = grads[name]
            if name in self.sharded:
                start, count = chunk_rows(g.shape[0], self.world)[self.rank]
                g = g[start:start + count]
            p.grad = g.clone().to(p.dtype)

    def full(self, name):
        p = self.params[name].detach()
        if name not in self.sharded:
            return p.clone()
        rows = chunk_rows(dict(SPECS)[name][0], self.world)
        per_rank = max(c for _, c in rows)
        padded = p.new_zeros((per_rank,) + tuple(p.shape[1:]))
        padded[: p.shape[0]] = p
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        # as bytes: gloo has no bfloat16
        dist.all_gather([t.reshape(-1).view(torch.uint8) for t in parts], padded.reshape(-1).view(torch.uint8),
                        group=self.group)
        return torch.cat([part[:c] for part, (_, c) in zip(parts, rows)])


def hyper_of(opt):
    out = {}
    for g in opt.param_groups:
        for n in g["names"]:
            out[n] = dict(g)
    return out


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


def compare(label, model, ref):
    worst = 0.0
    for name, _ in SPECS:
        full = model.full(name).double()
        err = float((full - ref.w[name]).norm() / ref.w[name].norm())
        worst = max(worst, err)
        check(err <= TOLERANCE, f"{label}: {name} relative error {err:.2e} > {TOLERANCE:.0e}")
    return worst


def same_on_every_rank(label, value):
    values = [None] * WORLD
    dist.all_gather_object(values, value)
    check(all(v == values[0] for v in values), f"{label}: differs across ranks: {values}")


# ---- the checks ----

MUON_NAMES = [n for n, s in SPECS if len(s) >= 2 and n not in ("embed.weight", "head.weight")]


def check_replicated():
    values = initial_values()
    model = Model(values)
    opt = DMuon(model.named(), weight_decay=0.01, adamw_weight_decay=0.1, clip_grad_norm=20.0, balancer="milp")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    check(sorted(opt.owners) == sorted(MUON_NAMES), f"replicated: Muon parameters {sorted(opt.owners)}")
    ref = Reference(values, {}, clip=20.0)
    run(model, opt, STEPS, ref=ref, sched=sched)
    check(opt.last_grad_norm > 20.0, f"replicated: clipping never active (norm {opt.last_grad_norm})")
    worst = compare("replicated", model, ref)
    for name, p in model.params.items():  # every rank applies the same updates: equal bits
        parts = [torch.empty_like(p) for _ in range(WORLD)]
        dist.all_gather(parts, p.detach())
        check(all(torch.equal(parts[0], q) for q in parts), f"replicated: {name} differs across ranks")
    return worst


def two_groups(model):
    names = [n for n, _ in SPECS]
    return [{"params": model.named(names[:6]), "lr": 0.02, "adamw_lr": 2e-3},
            {"params": model.named(names[6:]), "lr": 0.01, "nesterov": False, "adamw_lr": 1e-3, "adamw_betas": (0.8, 0.9)}]


def check_sharded():
    values = initial_values()
    model = Model(values, sharded_names=[n for n, _ in SPECS])
    opt = DMuon(two_groups(model), scale="original", balancer="lpt")
    check(len(opt.param_groups) == 4, f"sharded: {len(opt.param_groups)} param groups, expected 4")
    ref = Reference(values, {}, scale="original")
    run(model, opt, STEPS, ref=ref)
    return compare("sharded", model, ref)


MIXED_SHARDED = ["embed.weight", "layers.0.attn.weight", "layers.0.mlp.up.weight", "odd.weight", "tiny.weight",
                 "layers.0.mlp.up.bias"]


def mixed_optimizer(model):
    return DMuon(model.named(), balancer="rr", clip_grad_norm=30.0, weight_decay=0.05)


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
    torch.save(opt1.state_dict(), buffer)
    halfway = {n: first.full(n) for n, _ in SPECS}
    resumed = Model(halfway, MIXED_SHARDED)
    opt2 = mixed_optimizer(resumed)
    buffer.seek(0)
    opt2.load_state_dict(torch.load(buffer))
    run(resumed, opt2, STEPS - STEPS // 2, first_step=STEPS // 2)
    for name, _ in SPECS:
        check(torch.equal(resumed.params[name], straight.params[name]), f"resume: {name} not bit-identical")
    check(opt2.updates == STEPS, f"resume: {opt2.updates} updates after loading, expected {STEPS}")
    return worst


def check_reshard():
    """State saved at WORLD−1 ranks (ranks 0..WORLD−2), loaded at WORLD ranks."""
    sharded = [n for n, _ in SPECS]
    sub = dist.new_group(list(range(WORLD - 1)))
    values = initial_values()
    ref = Reference(values, {})
    saved = halfway = None
    if RANK < WORLD - 1:
        small = Model(values, sharded, group=sub)
        opt = DMuon(small.named(), process_group=sub)
        run(small, opt, STEPS // 2, ref=ref if RANK == 0 else None)
        saved = opt.state_dict()
        halfway = {n: small.full(n) for n, _ in SPECS}
    box = [saved, halfway, ref.w if RANK == 0 else None, ref.state if RANK == 0 else None]
    dist.broadcast_object_list(box, src=0)
    saved, halfway, ref.w, ref.state = box
    check(saved["dmuon"]["world_size"] == WORLD - 1, "reshard: saved world size")
    big = Model(halfway, sharded)
    opt = DMuon(big.named())
    opt.load_state_dict(saved)
    run(big, opt, STEPS - STEPS // 2, first_step=STEPS // 2, ref=ref)
    return compare(f"reshard {WORLD - 1}->{WORLD}", big, ref)


def check_bfloat16():
    """bf16 sharded parameters (momentum in bf16, rows sent as bytes, NS in float32; AdamW in torch
    ops, the engine's being float32) stay near the float32 run: bf16 keeps 8 bits, so 1e-2 relative."""
    values = initial_values()
    names = [n for n, _ in SPECS]
    f32 = Model(values, names)
    bf16 = Model({n: v.bfloat16() for n, v in values.items()}, names)
    opt32, opt16 = DMuon(f32.named()), DMuon(bf16.named())
    run(f32, opt32, 3)
    run(bf16, opt16, 3)
    for name in names:
        a, b = f32.full(name).double(), bf16.full(name).double()
        err = float((a - b).norm() / a.norm())
        check(err < 1e-2, f"bfloat16: {name} relative difference {err:.2e} to float32")


def expect_same_error(label, make, exception, *needles):
    message = None
    try:
        make()
    except exception as e:
        message = str(e)
    same_on_every_rank(label, message)
    check(message is not None, f"{label}: no {exception.__name__} raised")
    for needle in needles:
        check(message is not None and needle in message, f"{label}: '{needle}' not in: {message}")


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

    def on_meta():
        model = Model(values)
        model.params["odd.weight"] = torch.nn.Parameter(torch.empty(7, 12, device="meta"))
        return DMuon(model.named())
    expect_same_error("device", on_meta, ValueError, "odd.weight", "device meta")

    bad_rank = WORLD - 1
    for policy in ("error", "skip"):
        model = Model(values, MIXED_SHARDED)
        opt = DMuon(model.named(), nonfinite=policy)
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
    results = {"replicated": check_replicated(), "sharded": check_sharded(), "mixed": check_mixed_and_resume()}
    if WORLD > 1:
        results["reshard"] = check_reshard()
    check_bfloat16()
    check_errors()
    ok = torch.tensor([0 if failures else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if RANK == 0:
        worst = ", ".join(f"{k} {v:.1e}" for k, v in results.items())
        print(f"torch_dmuon_mpi_test np {WORLD}: worst relative error {worst}; "
              f"{'PASS' if int(ok) else 'FAIL'}", flush=True)
    dist.destroy_process_group()
    return 0 if int(ok) and not failures else 1


if __name__ == "__main__":
    RANK, WORLD = init_process_group("gloo")
    torch.manual_seed(0)
    sys.exit(main())
