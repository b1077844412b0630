"""torch.distributed's default process group from whatever started this process: torchrun (or the
tests' run_ranks.py, which sets the same variables), Open MPI's mpirun, or nothing (one rank).
"""

import datetime
import os

import torch.distributed as dist

from dmuon.torch.mpirun import init_process_group_from_mpirun


def init_process_group(backend="gloo", timeout_s=120):
    """Initialises the default process group; returns (rank, world size).

    torchrun's RANK and WORLD_SIZE (with MASTER_ADDR and MASTER_PORT) take precedence: env://, as
    torch.distributed.init_process_group does by default. Else mpirun's OMPI_COMM_WORLD_* variables
    (dmuon/torch/mpirun.py). Else one rank on an in-process store.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    elif "OMPI_COMM_WORLD_RANK" in os.environ:
        init_process_group_from_mpirun(backend, timeout_s)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()
