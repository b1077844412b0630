"""DMuon inside torchtitan under pipeline parallelism, at 4 ranks, on a (pp 2, fsdp 2) mesh: two of its debug models
(SDPA attention) split into stages by their own pipelining function (pipeline_llm: each stage parallelized by the
model's parallelize function, FSDP2 over the stage's 2 data-parallel ranks; and, on a (pp 2, tp 2) mesh, each stage
under tensor parallelism by the model's own TP plan, torch_titan_layouts_test's, in 1F1B: the loss under loss_parallel;
and DeepSeek-V3 in 1F1B with its routed experts over each stage's 2 ranks by its EP plan, expert parallelism 2):
  llama3       the Llama3 debugmodel cut to 4 layers, in 1F1B (one stage a rank, 2 stages) and Interleaved1F1B
               (two stages a rank, 4 stages; torchtitan's optimizer container builds a DMuon for each);
  deepseek-v3  the DeepSeek-V3 debugmodel cut to 4 layers (one dense, three of 8 routed experts, top 3; latent
               attention), in 1F1B;
each in the all-to-all mode and the owner-held mode (dmuon.torch.titan.owner_held around the parallelize function:
each stage's matrices held on its own data-parallel ranks; under TP each TP slice on its owner's TP group within the
stage, the expert stacks TP splits within their experts left to DMuon's all-to-all path; under EP each stack's EP
slice on its owner's EP group), each stage's DMuon over its
own ranks
(dmuon.torch.titan.stage_group, made by DMuonOptimizers), with QK-clip on each stage's attentions (titan_qk_clip with
the schedule, whose metadata-inference forward on uninitialized inputs it skips: counted, stage 1's first maxima
were NaN and the runs left the one process's; a tau that clips some heads at the first step). The steps are
Trainer.train_step's with PP: 2 micro-batches a step through the schedule's step() (arg_mbs on the first stage,
target_mbs and losses on the last), loss = summed cross-entropy / the global token count, torchtitan's
clip_grad_norm_ over the stages (pp_mesh; owner-held: dmuon.torch.clip_grad_norm_ with pipeline_group, as
torchtitan's cannot read held gradients), optimizers.step(), its LR schedulers' step(). The one process clips
with the norm summed in float64 (clip_in_float64 says why).

Every step's loss (the last stage's, summed over the data-parallel ranks), gradient norm and (llama3) the final
weights (every stage's, gathered) equal the same model unsplit and unsharded in one process (DMuon over a process
group of that rank alone) on the same batches, within framework_runs.TOLERANCE; DeepSeek-V3's weights are not
compared (its routed experts multiply in bfloat16: titan_cases.Case.exact), nor under TP its gradient norms
(TP splits those bfloat16 products: run() says why). Refused by name: DMuon's own
clip_grad_norm under PP (each stage clipped by its own norm), titan_qk_clip over stages without their schedule.

Run: PYTHONPATH=build/python:tests/python python tests/python/run_ranks.py --nproc 4 --timeout 400 -- \
    tests/python/torch_titan_pp_test.py DIR
"""

import contextlib
import dataclasses
import pathlib
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torchtitan.config import CompileConfig, ParallelismConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.models import deepseek_v3, llama3

import dmuon.torch
from dmuon.torch import DMuon, titan
from dmuon.torch.qk_clip_titan import titan_qk_clip
from framework_runs import TOLERANCE, compare, start
from rank_checks import check, finish
from rank_exit import exit_rank
from titan_cases import (MAX_NORM, PER_RANK, SCHEDULE, TRAINING, batches, held_names, initial_weights, load_full,
                         materialize, optimizer_config, two_layers_sdpa, with_parallel_plan)

STEPS, PP, DP = 3, 2, 2
# (pp 2, fsdp 1, tp 2): these cases and schedules in stages under tensor parallelism (the models' own TP plans)
TENSOR_PARALLEL = (("llama3", "1F1B"), ("deepseek-v3", "1F1B"))
# (pp 2, fsdp 2, ep 2): the MoE's routed experts over each stage's 2 ranks by its own EP plan (tokens by all-to-all)
EXPERT_PARALLEL = (("deepseek-v3", "1F1B"),)


@dataclasses.dataclass(frozen=True)
class PipelineCase:
    name: str
    spec: object  # () -> a fresh ModelSpec
    tau: float  # QK-clip's threshold: among the heads' largest logits at the first step (torch_titan_qk_clip_test)
    schedules: tuple
    steps: int
    # whether weights are compared, not only losses and gradient norms: the MoE's routed experts multiply in
    # bfloat16 (titan_cases.Case.exact)
    exact: bool


CASES = (PipelineCase("llama3", lambda: two_layers_sdpa(llama3.model_registry("debugmodel"), layers=4), 0.34,
                      ("1F1B", "Interleaved1F1B"), STEPS, exact=True),
         # DeepSeek-V3's first 4 layers: one dense, three of routed experts; latent attention
         PipelineCase("deepseek-v3", lambda: two_layers_sdpa(deepseek_v3.model_registry("debugmodel"), layers=4),
                      0.65, ("1F1B",), STEPS, exact=False))


def summed_loss(pred, labels, global_valid_tokens):
    """torchtitan's loss contract: (summed cross-entropy / the global token count, anything)."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), reduction="sum") / global_valid_tokens, None


def clip_in_float64(params):
    """torch.nn.utils.clip_grad_norm_(params, MAX_NORM) with the norm summed in float64: torch's float32 sum was
    5e-5 relative away from it here (2.117375 against 2.117544 at the first step), the ranks' sharded sums 3e-5.
    Returns the norm."""
    norm = float(sum(p.grad.double().pow(2).sum() for p in params)) ** 0.5
    for p in params:
        p.grad.mul_(min(1.0, MAX_NORM / (norm + 1e-6)))
    return norm


def reference(case, group, dp):
    """The model unsplit and unsharded in one process: the same container, scheduler and clipping, every step on
    the rows of all `dp` data-parallel ranks, one micro-batch (one row) at a time as the schedule runs them."""
    model = case.spec().model.build()
    model.load_state_dict(initial_weights(case))
    optimizers = optimizer_config(process_group=group).build(model_parts=[model])
    (clip,) = titan_qk_clip([model], optimizers, case.tau)
    schedulers = SCHEDULE.build(optimizers=optimizers, training_steps=STEPS)
    losses, norms = [], []
    for rows in batches(case, dp):  # (dp · PER_RANK, SEQ + 1): every data-parallel rank's rows
        optimizers.zero_grad(set_to_none=False)
        loss = 0.0
        for row in rows.split(1):
            part, _ = summed_loss(model(row[:, :-1]), row[:, 1:], rows[:, 1:].numel())
            part.backward()
            loss += part.item()
        norms.append(clip_in_float64(list(model.parameters())))
        optimizers.step()
        schedulers.step()
        losses.append(loss)
        clipped = int(sum((m > case.tau).sum() for m in clip.max_logits))
        check(0 < clipped < sum(m.numel() for m in clip.max_logits) or len(losses) > 1,
              f"{case.name}: step 1 clipped {clipped} heads, not some of them")
    return (losses, norms), {k: v.detach().clone() for k, v in model.state_dict().items()}


def build(case, schedule, out, held=False, dp=DP, tp=1, ep=1, **options):
    """Trainer.__init__'s order under PP: the model on the meta device, pipelining_fn (stages, each parallelized:
    FSDP2 over dp ranks, tensor parallelism over tp, the routed experts over ep of the dp ranks), to_empty and
    init_weights per part, the optimizers (then the reference's weights), the LR schedulers."""
    spec = case.spec()
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", pipeline_parallel_degree=PP,
                                    pipeline_parallel_schedule=schedule, tensor_parallel_degree=tp,
                                    expert_parallel_degree=ep)
    if tp > 1 or ep > 1:
        spec = with_parallel_plan(spec, parallelism)
    if held:
        spec = dataclasses.replace(spec, parallelize_fn=titan.owner_held(spec.parallelize_fn))
    dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=PP, ep=ep, world_size=PP * dp * tp,
                        spmd_backend="partial_dtensor")
    dims.build_mesh()
    with torch.device("meta"):
        model = spec.model.build()
    pp_schedule, parts, first, last = spec.pipelining_fn(
        model, parallel_dims=dims, training=TRAINING, parallelism=parallelism, compile_config=CompileConfig(),
        ac_config=None, dump_folder=str(out), device=torch.device("cpu"), model_config=spec.model,
        parallelize_fn=spec.parallelize_fn, loss_fn=summed_loss)
    weights = initial_weights(case)
    for part in parts:
        materialize(part)
        load_full(part, {k: v for k, v in weights.items() if k in part.state_dict()})
    optimizers = optimizer_config(**options).build(model_parts=parts)
    check([type(o) for o in optimizers] == [DMuon] * len(parts),
          f"torchtitan built {[type(o) for o in optimizers]} for {len(parts)} model parts")
    titan_qk_clip(parts, optimizers, case.tau, pp_schedule=pp_schedule)
    schedulers = SCHEDULE.build(optimizers=optimizers, training_steps=STEPS)
    return dims, pp_schedule, parts, first, last, optimizers, schedulers


def train_step(dims, pp_schedule, parts, first, last, optimizers, schedulers, rows, held):
    """Trainer.train_step's with PP: (the loss summed over the data-parallel ranks on the last stage, else None;
    the gradient norm before clipping)."""
    optimizers.zero_grad(set_to_none=TRAINING.disable_cuda_graphs)
    batch = dims.get_optional_mesh("batch")  # None with one data-parallel rank
    tokens = torch.tensor(rows[:, 1:].numel())
    tokens = dist_utils.dist_sum_tensor(tokens, batch) if batch is not None else tokens
    mbs = list(rows.split(1))
    losses = [] if last else None
    with loss_parallel() if dims.tp_enabled else contextlib.nullcontext():  # TP: the head's logits are shards
        pp_schedule.step(arg_mbs=[(mb[:, :-1],) for mb in mbs] if first else None, kwarg_mbs=[{} for _ in mbs],
                         target_mbs=[mb[:, 1:] for mb in mbs] if last else None, losses=losses,
                         loss_kwargs={"global_valid_tokens": tokens}, return_outputs=False)
    params = [p for m in parts for p in m.parameters()]
    if held:  # torchtitan's clip_grad_norm_ cannot read held gradients (torch_titan_test)
        norm = dmuon.torch.clip_grad_norm_(params, MAX_NORM, pipeline_group=dims.get_mesh("pp").get_group())
    else:
        norm = dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=dims.get_optional_mesh("pp"),
                                          ep_enabled=dims.ep_enabled)
    optimizers.step()
    schedulers.step()
    loss = torch.stack([l.full_tensor() if isinstance(l, DTensor) else l for l in losses]).detach().sum() if last \
        else torch.zeros(())
    if batch is not None:
        dist.all_reduce(loss, group=batch.get_group())
    return (float(loss) if last else None), float(norm)


def full_weights(parts):
    """Every stage's weights as full tensors, on every rank (each stage's gathered on its ranks, then shared)."""
    mine = {}
    for part in parts:
        mine.update({k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in
                     part.state_dict().items()})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {k: v for d in everyone for k, v in d.items()}


def refusal(out):
    """Refused by name: DMuon's own clip_grad_norm under PP (each stage would be clipped by its own norm), and
    titan_qk_clip over pipeline stages without their schedule (whose metadata inference it must not count)."""
    try:
        build(CASES[0], "1F1B", out / "refusal", clip_grad_norm=1.0)
        check(False, "DMuonOptimizers took DMuon's clip_grad_norm under pipeline parallelism")
    except ValueError as e:
        check("DMuon's clip_grad_norm under pipeline parallelism" in str(e), f"the refusal names no setting: {e}")
    _, _, parts, _, _, optimizers, _ = build(CASES[0], "1F1B", out / "refusal")
    try:
        titan_qk_clip(parts, optimizers, 1.0)
        check(False, "titan_qk_clip took pipeline stages without their schedule")
    except ValueError as e:
        check("give pp_schedule=" in str(e), f"the refusal names no pp_schedule: {e}")


def main():
    out = pathlib.Path(sys.argv[1])
    rank, world, refs = start(out, lambda world, group: {(c.name, dp): reference(c, group, dp) for c in CASES
                                                         for dp in (DP, 1)})
    check(world == PP * DP, f"torch_titan_pp_test runs at {PP * DP} ranks, not {world}")
    refusal(out)
    for case in CASES:
        for schedule in case.schedules:
            for held in (False, True):
                run(case, schedule, held, out / case.name / schedule, refs)
        for schedule in (s for name, s in TENSOR_PARALLEL if name == case.name):
            for held in (False, True):
                run(case, schedule, held, out / case.name / f"{schedule}-tp", refs, dp=1, tp=2)
        for schedule in (s for name, s in EXPERT_PARALLEL if name == case.name):
            for held in (False, True):
                run(case, schedule, held, out / case.name / f"{schedule}-ep", refs, ep=2)
    return finish(f"torch_titan_pp_test at {world} ranks: torchtitan's Llama3 (4 layers; 1F1B, Interleaved1F1B) and "
                  f"DeepSeek-V3 (4 layers, 3 of experts; 1F1B) debug models in pipeline stages over FSDP2 and (1F1B) "
                  f"over TP and EP, both modes, one DMuon a stage, QK-clip, {STEPS} steps, vs one process")


def run(case, schedule, held, out, refs, dp=DP, tp=1, ep=1):
    """One case's run in one schedule, mode and layout, checked on rank 0 against the one process's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dims, pp_schedule, parts, first, last, optimizers, schedulers = build(case, schedule, out, held, dp, tp, ep)
    held_here = sum(len(held_names(part)) for part in parts)
    check(held == (held_here > 0),
          f"{case.name} {schedule}: {held_here} matrices held on rank {rank}, mode held={held}")
    dp_rank = dims.get_mesh("batch").get_local_rank() if dp > 1 else 0
    rows = batches(case, dp)[:, dp_rank * PER_RANK:(dp_rank + 1) * PER_RANK]
    steps = [train_step(dims, pp_schedule, parts, first, last, optimizers, schedulers, rows[s], held)
             for s in range(STEPS)]
    weights = full_weights(parts)
    losses = [None] * world
    dist.all_gather_object(losses, [l for l, _ in steps] if last else None)
    if rank == 0:
        label = (f"torchtitan {case.name} {schedule} (pp {PP} x fsdp {dp}{f' x tp {tp}' if tp > 1 else ''}"
                 f"{f', experts on ep {ep}' if ep > 1 else ''}, "
                 f"{len(parts)} stage(s) a rank) "
                 f"{'owner-held' if held else 'all-to-all'}")
        norms = [n for _, n in steps]
        (ref_losses, ref_norms), ref_weights = refs[(case.name, dp)]
        # DeepSeek-V3 under TP: its bfloat16 expert products are split by TP (w2 row-wise: partial sums rounded to
        # bfloat16, then added), so the first step's gradient norm, before any update, was 5.9e-5 relative from the
        # one process's: a difference of the forward and backward, not of the optimizer; its losses are compared
        check((not case.exact and tp > 1) or all(abs(a - b) <= TOLERANCE * b for a, b in zip(norms, ref_norms)),
              f"{label}: gradient norms {norms}, the one process's {ref_norms}")
        compare(label, next(l for l in losses if l is not None), weights if case.exact else {}, ref_losses,
                ref_weights if case.exact else {})
        print(f"{label}: gradient norms {[f'{n:.6f}' for n in norms]} (one process "
              f"{[f'{n:.6f}' for n in ref_norms]})", flush=True)
    dist.barrier()


if __name__ == "__main__":
    exit_rank(main())
