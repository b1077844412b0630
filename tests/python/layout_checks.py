"""What the multi-rank layout tests (torch_fsdp2_test, torch_tp_ep_test, torch_qk_clip_tp_test) share: DMuon's
hyper-parameters and the tolerance against the float64 reference (muon_reference.Reference), their per-rank report
(Checks), comparisons and sums over the ranks, the same-error check of a refusal, and the collectives' count."""

import sys
import traceback
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

TOLERANCE = 1e-5  # parameters after STEPS steps vs the float64 reference fed the same gradients
# ns_dtype pinned: the tolerances are float32's, whatever the machine's default Newton–Schulz dtype.
HYPER = dict(lr=0.02, weight_decay=0.01, adamw_lr=3e-3, adamw_betas=(0.9, 0.95), adamw_eps=1e-8,
             adamw_weight_decay=0.1, ns_dtype="float32")
U_F32 = 2.0 ** -24  # float32's unit roundoff


class Checks:
    def __init__(self, rank, world, test="torch_fsdp2_test"):
        self.rank, self.world, self.test, self.failed = rank, world, test, []

    def report(self, name, ok, detail):
        line = f"{self.test} np{self.world} rank {self.rank}: {'PASS' if ok else 'FAIL'} {name}: {detail}\n"
        sys.stdout.write(line)  # one write per line: the ranks share the output
        sys.stdout.flush()
        if not ok:
            self.failed.append(name)

    def within(self, name, errors, tolerance):
        """errors: {tensor: relative error}; passes when the worst is within tolerance."""
        tensor, worst = max(errors.items(), key=lambda kv: kv[1])
        self.report(name, worst <= tolerance,
                    f"worst relative error {worst:.2e} ({tensor}), tolerance {tolerance:.1e}")

    def run(self, name, fn, *args):
        """Runs one check function; an exception fails it (with its traceback) instead of ending the job."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - reported, then the next check runs
            self.report(name, False, f"raised {type(e).__name__}: {e}")
            traceback.print_exc()


def relative_error(x, ref):
    x, ref = x.detach().double(), ref.detach().double()
    scale = float(ref.norm())
    return float((x - ref).norm()) / scale if scale > 0 else float(x.norm())


def all_ranks_sum(value):
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def expect_same_error(checks, name, make, group_ranks, *needles):
    """make() must raise ValueError on every rank, with the same message on the ranks of group_ranks
    (this rank's optimizer group) and every needle in it."""
    message = None
    try:
        make()
    except ValueError as e:
        message = str(e)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message)
    mine = [gathered[r] for r in group_ranks]
    ok = message is not None and all(m == message for m in mine) and all(s in message for s in needles)
    detail = (f"ValueError on ranks {group_ranks}: {message}" if ok
              else f"messages on ranks {group_ranks}: {mine}; expected the same ValueError naming {list(needles)}")
    checks.report(name, ok, detail)


class CollectiveBytes(TorchDispatchMode):
    """Calls of each collective (c10d and functional collectives) while active, and the bytes of the
    tensors handed to them."""

    MOVING = ("all", "broadcast", "reduce", "scatter", "gather", "send", "recv")

    def __init__(self):
        super().__init__()
        self.calls, self.bytes = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.__name__.split(".")[0]
        if func.namespace in ("c10d", "_c10d_functional") and any(w in op for w in self.MOVING):
            self.calls[op] += 1
            self.bytes[op] += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs))
                                  if isinstance(t, torch.Tensor))
        return func(*args, **(kwargs or {}))
