"""torch.distributed from an `mpirun -np N python …` launch, without MPI in Python, or from torchrun.

Rank and size come from Open MPI's OMPI_COMM_WORLD_* variables. With MASTER_ADDR and MASTER_PORT
set, the rendezvous is env://; otherwise it is a file store in the launch's own session folder
(OMPI_MCA_orte_jobfam_session_dir, unique per mpirun and removed by it), so concurrent launches never
compete for a TCP port.
"""

import datetime
import os

import torch.distributed as dist


def init_process_group_from_mpirun(backend="gloo", timeout_s=120):
    """Initialises the default process group; returns (rank, world size)."""
    try:
        rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
        world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    except KeyError:
        raise RuntimeError("not started by Open MPI's mpirun (no OMPI_COMM_WORLD_RANK/SIZE)") from None
    timeout = datetime.timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    else:
        session = os.environ.get("OMPI_MCA_orte_jobfam_session_dir")
        job = os.environ.get("OMPI_MCA_ess_base_jobid", "0")
        if not session or not os.path.isdir(session):
            raise RuntimeError("no Open MPI session folder; set MASTER_ADDR and MASTER_PORT for env://")
        store = os.path.join(session, f"dmuon_torch_store.{job}")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world, timeout=timeout)
    return rank, world


def init_process_group(backend="gloo", timeout_s=120):
    """Initialises the default process group under mpirun (as init_process_group_from_mpirun) or
    under torchrun (env://, from the variables torchrun sets); returns (rank, world size)."""
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        return init_process_group_from_mpirun(backend, timeout_s)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
