"""What the multi-rank torch tests' ranks share: failed checks, sums over the ranks, and the verdict.

check() records a failure on this rank (and prints it); finish() makes every rank agree on the
verdict (one failing rank fails the job), prints the summary line with PASS or FAIL on rank 0,
destroys the process group and returns the exit code.
"""

import torch
import torch.distributed as dist

failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print(f"rank {dist.get_rank()}: FAIL {what}", flush=True)


def total_over_ranks(value):
    t = torch.tensor([float(value)], dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return float(t)


def finish(summary):
    ok = torch.tensor([0 if failures else 1])
    if dist.get_world_size() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        print(f"{summary}; {'PASS' if int(ok) else 'FAIL'}", flush=True)
    dist.destroy_process_group()
    return 0 if int(ok) and not failures else 1
