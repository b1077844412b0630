"""One definition of a Muon matrix (python/dmuon/torch/matrices.py), at 2 ranks on gloo: every path that decides
what a parameter's matrices are agrees with the rule, restated here as EXPECTED, for a model with
  moe.w               a (4, 8, 8) stack of experts that only the custom predicate (EXPERTS) names: 4 matrices 8×8
  expert_mix.weight   a Conv1d (8, 8, 2) that the default predicate would take for a stack ("expert" in its name)
                      and EXPERTS takes for a filter: one 8×16 matrix
  conv1.weight        a Conv1d (6, 4, 3): one 6×12 matrix
  conv2.weight        a Conv2d (8, 6, 2, 2): one 8×24 matrix
  qkv.weight          a fused qkv (24, 8) split by split_sizes [8, 4, 12]: blocks 8×8, 4×8, 12×8
The paths, in both modes (all-to-all; owner-held by hold_on_owners with experts=EXPERTS and split=), under FSDP2
(fully_shard on a 1-D mesh) and under TP/EP (the stack Shard(0) by experts, the qkv Shard(0) column-wise, the
filters Shard(0) on their output channels, over a 1-D mesh; owner-held: the stack and the qkv held as their
slices, through held/tensor_parallel.py's frame):
  costing   the owner planner's input (dmuon.plan_owners, recorded on rank 0): owner-held, each held parameter's
            blocks are its matrices' blocks (EXPECTED, a whole matrix as one block); all-to-all, each planned
            matrix's blocks are one of EXPECTED's matrices'
  step      the Newton–Schulz the engine ran in one step (engine.orthogonalize and engine.update, recorded on
            every rank): EXPECTED's blocks, each once over the ranks, nothing else
  held      under FSDP2 owner-held every matrix is held, and DMuon is built with the default predicate, which
            disagrees on moe.w and expert_mix.weight: the step still updates each as hold_on_owners (EXPERTS) took it
Run: torchrun --standalone --nproc_per_node 2 tests/python/torch_matrix_model_test.py (PYTHONPATH=build/python).
"""

import re

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dmuon
from dmuon.torch import DMuon, hold_on_owners
from dmuon.torch.dtensors import is_dtensor, local_part
from dmuon.torch.held.placeholder import HeldElsewhere
from rank_checks import check, finish
from rank_exit import exit_rank

SPLIT = [8, 4, 12]
MATRICES = {"moe.w": [[(8, 8)]] * 4, "expert_mix.weight": [[(8, 16)]], "conv1.weight": [[(6, 12)]],
            "conv2.weight": [[(8, 24)]], "qkv.weight": [[(8, 8), (4, 8), (12, 8)]]}  # per matrix, its blocks
EXPECTED = {name: [block for blocks in matrices for block in blocks] for name, matrices in MATRICES.items()}
TP_HELD = ("moe.w", "qkv.weight")  # held under TP/EP: the slices of one mesh (filters cannot be held there)


def EXPERTS(name, shape):
    return name.startswith("moe.")


def split(name, p):
    return {"split_sizes": SPLIT} if name == "qkv.weight" else {}


class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8, 8) / 8)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv1d(4, 6, 3, bias=False)
        self.conv2 = torch.nn.Conv2d(6, 8, 2, bias=False)
        self.expert_mix = torch.nn.Conv1d(8, 8, 2, bias=False)
        self.qkv = torch.nn.Linear(8, 24)
        self.moe = Experts()


def distribute(model, mesh):
    """Every matrix Shard(0) over mesh (experts of the stack, output rows of the rest), the bias replicated."""
    for name, p in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        placements = [Replicate()] if p.dim() == 1 else [Shard(0)]
        setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(distribute_tensor(p.detach(), mesh,
                                                                                             placements)))


def set_gradients(model):
    """The same full gradients on every rank, laid out as each parameter (none on a placeholder)."""
    torch.manual_seed(7)
    for name, p in model.named_parameters():
        g = torch.randn(p.shape)
        if isinstance(local_part(p), HeldElsewhere):
            continue
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if is_dtensor(p) else g


def groups(model):
    named = list(model.named_parameters())
    return [{"params": [(n, p) for n, p in named if n == "qkv.weight"], "split_sizes": SPLIT},
            {"params": [(n, p) for n, p in named if n != "qkv.weight"]}]


class Recorder:
    """The owner planner's inputs on this rank ((shapes, blocks) per call of dmuon.plan_owners) and the Newton–Schulz
    an optimizer's engine runs ((parameter name, (rows, cols)) per matrix or block)."""

    def __init__(self):
        self.plans, self.ran = [], []
        self._plan_owners = dmuon.plan_owners

        def plan_owners(shapes, world, **kwargs):
            self.plans.append(([tuple(s) for s in shapes], kwargs.get("blocks")))
            return self._plan_owners(shapes, world, **kwargs)
        dmuon.plan_owners = plan_owners

    def close(self):
        dmuon.plan_owners = self._plan_owners

    def watch(self, opt):
        engine = opt.engine
        orthogonalize, update = engine.orthogonalize, engine.update

        def orthogonalizing(ns, matrices, names):
            self.ran.extend((_parameter(n), tuple(m.shape)) for n, m in zip(names, matrices))
            return orthogonalize(ns, matrices, names)

        def updating(ns, entries, rows, cols, *rest):
            self.ran.extend((_parameter(n), (rows, cols)) for n in rest[-1])
            return update(ns, entries, rows, cols, *rest)
        engine.orthogonalize, engine.update = orthogonalizing, updating


def _parameter(matrix_name):
    """The parameter of a matrix's or block's name ("moe.w[2]", "qkv.weight:rows 8+4")."""
    return re.sub(r"\[\d+\]$", "", matrix_name.split(":")[0])


def check_plans(label, plans, held):
    """Rank 0's planner inputs against EXPECTED: held, per parameter (in the model's order) its blocks; else each
    planned matrix's blocks (or its shape) one of EXPECTED's matrices' blocks."""
    if dist.get_rank() != 0:
        return
    check(plans, f"{label}: the owner planner was never called on rank 0")
    if held:
        names = [n for n in HELD_ORDER if n in held]
        shapes, blocks = plans[0]
        check(blocks is not None and len(blocks) == len(names)
              and all(sorted(b) == sorted(EXPECTED[n]) for n, b in zip(names, blocks)),
              f"{label}: hold_on_owners costed {dict(zip(names, blocks or []))}, the matrices are "
              f"{ {n: EXPECTED[n] for n in names} }")
        return
    matrices = [blocks for name in MATRICES for blocks in MATRICES[name]]
    for shapes, blocks in plans:
        for i, shape in enumerate(shapes):
            got = list(blocks[i]) if blocks and blocks[i] else [shape]
            check(got in matrices, f"{label}: DMuon's planner costed a matrix as {got}, none of the model's")


def check_step(label, ran):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ran)
    got = {}
    for name, shape in (item for part in everyone for item in part):
        got.setdefault(name, []).append(shape)
    check({n: sorted(s) for n, s in got.items()} == {n: sorted(s) for n, s in EXPECTED.items()},
          f"{label}: one step ran Newton–Schulz on {got}, the matrices are {EXPECTED}")


HELD_ORDER = [n for n, _ in Net().named_parameters()]


def run(label, mesh, held_mode, fsdp):
    torch.manual_seed(0)
    model = Net()
    recorder = Recorder()
    try:
        held = None
        if not fsdp:
            distribute(model, mesh)
        if held_mode:
            predicate = (lambda n, p: n in TP_HELD) if not fsdp else None
            held = hold_on_owners(model, mesh if fsdp else None, experts=EXPERTS, split=split, predicate=predicate)
        if fsdp:
            fully_shard(model, mesh=mesh, ignored_params=held.params if held else None)
        every_one_held = held_mode and fsdp  # then DMuon's own predicate decides nothing
        opt = DMuon(groups(model)) if every_one_held else DMuon(groups(model), experts=EXPERTS)
        recorder.watch(opt)
        set_gradients(model)
        opt.step()
        check_plans(label, recorder.plans, held.names if held else None)
        check_step(label, recorder.ran)
    finally:
        recorder.close()


def main():
    world = dist.get_world_size()
    if world != 2:
        print(f"torch_matrix_model_test runs at 2 ranks, not {world}", flush=True)
        return 1
    mesh = init_device_mesh("cpu", (world,))
    for fsdp, where in ((True, "FSDP2"), (False, "TP/EP")):
        for held_mode, mode in ((False, "all-to-all"), (True, "owner-held")):
            run(f"{where} {mode}", mesh, held_mode, fsdp)
    return finish(f"torch_matrix_model_test at {world} ranks: costing, the step and the TP/EP frame of a stack, "
                  "filters and a split qkv under a custom experts predicate, both modes, FSDP2 and TP/EP")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    exit_rank(main())
