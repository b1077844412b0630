"""QK-clip (dmuon.torch.hf_qk_clip) under tensor parallelism, on gloo (CPU): Hugging Face transformers' Qwen2
(tp_cases.py's small config: 4 query heads, 2 key-value heads, its own base_model_tp_plan applied with torch's
parallelize_module: q_proj and k_proj column-wise, so each TP rank computes 2 query heads and 1 key head) trained
STEPS steps with DMuon and hf_qk_clip at a threshold that clips some heads and not others, against the same model
whole on each rank with DMuon and hf_qk_clip over a process group of that rank alone (the single-process
definition, itself checked against Kimi K2's rule in float64 by torch_muon_options_test) fed the whole batch (for its
maxima) and then the distributed run's gradients, gathered (a gradient's rounding is not under test here).

Run: OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node N \
         tests/python/torch_qk_clip_tp_test.py            (N = 2 or 4; PYTHONPATH with dmuon)
  N=2  TP 2; N=4  FSDP2 (dp 2) × TP 2 (fully_shard over parallelize_module: _StridedShard rows). Each in the
       all-to-all mode and the owner-held mode (hold_on_owners after parallelize_module: each TP slice held on its
       owner's TP group), eager and sdpa attention; and laid out by transformers itself (its DistributedConfig: tp 2,
       fsdp 2 at 4 ranks; what from_pretrained(distributed_config=...) does), sdpa.
Checks, per layout:
  maxima   QKClip.max_logits at every step (every rank's heads, taken into one step) against the reference's, and
           the heads each rank reported: its TP rank's two (a map taking the local heads for heads 0, 1 fails);
  clipped  the reference clipped some heads and left others at some step (else the check proves nothing);
  params   every parameter after STEPS steps against the reference's within TOLERANCE (layout_checks' 1e-5
           relative, Frobenius: float32 on both sides, the gradients summed in other orders).
"""

import datetime

import torch
import torch.distributed as dist

from dmuon.torch import DMuon, hf_qk_clip
from layout_checks import HYPER, TOLERANCE, Checks, relative_error
from rank_checks import failures, finish
from rank_exit import exit_rank
from tp_cases import BATCH, full_of, qwen2_batch, qwen2_case, tp_and_fsdp2

STEPS = 3
TAU = 0.045  # the tiny Qwen2's largest logits are 0.034..0.062 in these steps: some heads clipped, others not


def solo_groups():
    """Per rank, a process group of that rank alone (every rank creates every one, in order)."""
    return [dist.new_group([r]) for r in range(dist.get_world_size())]


def reference_run(attention, solo):
    """The single-process run: the model whole, DMuon over a group of this rank alone. (model, optimizer, its
    QKClip)."""
    model, _, _, _, _, _ = qwen2_case()
    model.config._attn_implementation = attention
    opt = DMuon(model, process_group=solo, **HYPER)
    return model, opt, hf_qk_clip(model, opt, TAU)


def transformers_layout(world, model):
    """The model laid out by transformers itself (what from_pretrained(distributed_config=...) does between init and
    weight loading): DistributedConfig with tp 2 (and fsdp 2 at 4 ranks), its base_model_tp_plan and FSDP2 pass.
    (name, data-parallel size, this rank's place there, None)."""
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(tp_size=2, **({"fsdp_size": world // 2} if world > 2 else {}))
    layout, _, meshes = type(model).prepare_distribute_model(config)
    type(model).maybe_distribute_model(model, layout, meshes)
    dp_rank = meshes.get_mesh(("fsdp", "tp")).get_local_rank("fsdp") if world > 2 else 0
    return f"transformers' own (fsdp {layout.fsdp_size} x tp {layout.tp_size})", layout.dp_size, dp_rank, None


def check_layout(checks, world, attention, held, solo, layout_by="torch"):
    ref, ref_opt, ref_clip = reference_run(attention, solo)
    ref_params = dict(ref.named_parameters())
    model, base, plan, blocks, loss, _ = qwen2_case()
    model.config._attn_implementation = attention
    if layout_by == "transformers":
        layout, dp, dp_rank, holding = transformers_layout(world, model)
    else:
        layout, dp, dp_rank, holding = tp_and_fsdp2(world, model, base, plan, blocks, held)
    name = f"qwen2 {attention} {layout}" + (" owner-held" if held else "")
    params = dict(model.named_parameters())
    held_at = {n: p._dmuon_held.holdings for n, p in params.items() if getattr(p, "_dmuon_held", None) is not None}
    opt = DMuon(model, **HYPER)
    clip = hf_qk_clip(model, opt, TAU)
    reported = []
    report = clip.report
    clip.report = lambda i, maxima, heads=None: (reported.append((i, heads)), report(i, maxima, heads))[1]
    maxima_errors, clipped = {}, set()
    for step in range(STEPS):
        batch = qwen2_batch(torch.Generator().manual_seed(200 + step))
        loss(model, batch[dp_rank * BATCH // dp:(dp_rank + 1) * BATCH // dp]).backward()
        loss(ref, batch).backward()  # the reference's maxima, from the whole batch
        for n, p in ref_params.items():  # and the same gradients (a gradient's rounding is not under test)
            p.grad = full_of(params[n].grad, held_at.get(n))
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        want = torch.stack(ref_clip.max_logits)  # (layers, heads)
        maxima_errors[f"step {step}"] = relative_error(torch.stack(clip.max_logits), want)
        clipped |= {bool(v) for v in (want > TAU).flatten().tolist()}
    tp_rank = dist.get_rank() % 2  # tp is the mesh's last dim
    heads = {h for _, hs in reported for h in hs}
    checks.report(f"{name}: each rank reports its TP rank's query heads", heads == {2 * tp_rank, 2 * tp_rank + 1},
                  f"heads {sorted(heads)} in {len(reported)} reports, TP rank {tp_rank}")
    checks.within(f"{name}: max logits vs the single-process run", maxima_errors, TOLERANCE)
    checks.report(f"{name}: the threshold clips some heads and not others", clipped == {True, False},
                  f"heads above tau={TAU} over the steps: {sorted(clipped)}")
    if held:
        with holding.unshard():
            final = {n: full_of(p, None) for n, p in model.named_parameters()}
    else:
        final = {n: full_of(p, held_at.get(n)) for n, p in params.items()}
    checks.within(f"{name}: params vs the single-process run", {n: relative_error(final[n], ref_params[n])
                                                                  for n in final}, TOLERANCE)


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world not in (2, 4):
        raise SystemExit(f"torch_qk_clip_tp_test runs at 2 or 4 ranks, not {world}")
    checks = Checks(rank, world, "torch_qk_clip_tp_test")
    solo = solo_groups()[rank]
    for attention, held in (("eager", False), ("eager", True), ("sdpa", False)):
        checks.run(f"{attention} held={held}", check_layout, checks, world, attention, held, solo)
    checks.run("transformers' layout", check_layout, checks, world, "sdpa", False, solo, "transformers")
    failures.extend(checks.failed)
    return finish(f"torch_qk_clip_tp_test np{world}")


if __name__ == "__main__":
    exit_rank(main())
