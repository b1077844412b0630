"""optimizer.state_dict() called on rank 0 alone returns (torch's convention: it is local), under a
2-rank job, with replicated matrices whose momentum lives on rank 1 and sharded ones.

Rank 0 calls state_dict() under a watchdog (faulthandler prints its stack and exits 1 after
WAIT_S seconds), then tells rank 1 through the job's TCPStore, on which rank 1 waits at most WAIT_S
seconds; a collective state_dict() would leave rank 0 waiting for rank 1 and fail both. Afterwards
both ranks take a step together: the process group is still in step (no collective left half-done),
and the replicated parameters are bit-identical across the ranks.

Run: torchrun --standalone --nproc_per_node 2 tests/python/torch_state_dict_one_rank_test.py
(PYTHONPATH=build/python, one BLAS thread per rank).
"""

import datetime
import faulthandler
import os

import torch
import torch.distributed as dist

from dmuon.torch import DMuon
from hand_sharded_model import SPECS, Model, gradients, initial_values
from rank_exit import exit_rank

WAIT_S = 120  # far above a small model's state_dict() (well under a second), far below ctest's timeout
SHARDED = ["odd.weight", "tiny.weight", "layers.0.mlp.up.bias"]
DONE_KEY = "torch_state_dict_one_rank_test/rank0_returned"


def main():
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        print(f"torch_state_dict_one_rank_test needs 2 ranks, got {world}", flush=True)
        return 1
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=WAIT_S))
    model = Model(initial_values(), SHARDED)
    opt = DMuon(model.named(), balancer="rr")
    check = []
    check.append((sorted(set(opt.owners.values())) == [0, 1], f"owners on both ranks: {opt.owners}"))
    for step in range(2):
        model.set_grads(gradients(step))
        opt.step()
    if rank == 0:
        faulthandler.dump_traceback_later(WAIT_S, exit=True)
        state = opt.state_dict()
        faulthandler.cancel_dump_traceback_later()
        store.set(DONE_KEY, "1")
        check.append((isinstance(state, dict) and {"state", "param_groups"} <= set(state),
                      f"state_dict() returned {type(state).__name__} with keys {list(state)[:5]}"))
    else:
        try:
            store.wait([DONE_KEY])
        except RuntimeError as e:  # torch raises DistStoreError, a RuntimeError, on a timeout
            print(f"rank 1: rank 0's state_dict() did not return within {WAIT_S} s ({e})", flush=True)
            return 1
    model.set_grads(gradients(2))
    opt.step()
    for name, _ in SPECS:
        if name not in SHARDED:
            values = [None, None]
            dist.all_gather_object(values, model.params[name].detach())
            check.append((torch.equal(values[0], values[1]), f"{name} differs across ranks after the step"))
    failed = [what for ok, what in check if not ok]
    for what in failed:
        print(f"rank {rank}: FAIL {what}", flush=True)
    ok = torch.tensor([0 if failed else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"torch_state_dict_one_rank_test: {'PASS' if int(ok) else 'FAIL'}", flush=True)
    dist.destroy_process_group()
    return 0 if int(ok) else 1


if __name__ == "__main__":
    dist.init_process_group("gloo")
    exit_rank(main())
