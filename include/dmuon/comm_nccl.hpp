// The NCCL communicator: dmuon::comm::Comm over GPU buffers (DESIGN 6), for builds with NCCL (DMUON_HAVE_NCCL).
//
// One GPU per rank: rank r uses the CUDA device with the index of r within its node (the MPI node
// communicator), and NCCL refuses two ranks on one GPU (ncclCommInitRank fails with "Duplicate GPU detected"),
// so a multi-rank run on one GPU uses the MPI communicator on host-staged buffers instead.
// Same contract as comm.hpp, with these differences:
//  - Buffers are device memory of the CUDA backend passed in. A collective is queued on the communicator's own
//    stream after everything queued on the backend's stream so far (an event, no host wait), so its inputs are
//    ready; its Work completes on a CUDA event recorded after it, and test()/wait() poll that event (and NCCL's
//    asynchronous error state). Work queued on the backend after wait() returns sees the results.
//  - All-gather(v) with uneven counts and uneven reduce-scatter(v) are grouped ncclSend/ncclRecv; an uneven
//    reduce-scatter sums the received blocks in rank order with a kernel. Equal counts use ncclAllGather /
//    ncclReduceScatter; averages use ncclAvg.
//  - The unique id is made on rank 0 and broadcast over the MPI communicator; node() and cross() are
//    ncclCommSplit children grouped as the MPI world's are.
//  - Host memory is accepted too (device_buffers() is true): a collective whose buffers are all host memory
//    (small control messages: registry checks, agreements, the optimizer's flags) runs on the MPI communicator
//    the NCCL one was made from; one that mixes host and device buffers is refused.
//  - Options::check_calls (DMUON_COMM_CHECK=1) is not offered: the constructor refuses it.
#pragma once

#include <memory>

#include "dmuon/comm.hpp"

namespace dmuon {
class Backend;  // dmuon/backend.hpp (the backend layer; this header is the comm layer's)
}

namespace dmuon::comm {

// This rank's GPU: its index within its node (mpi_world.node().rank()). Not collective.
int local_device_index(Comm& mpi_world);

// Collective over mpi_world: local_device_index, once every rank has checked that it has that GPU and that no
// two ranks of a node hold the same one (by device UUID). Otherwise throws dmuon::Error on every rank: the
// rank without a GPU (or the ranks that would share one) name the rank, its node index and the GPU count; the
// others say that another rank failed.
int rank_device(Comm& mpi_world);

// A NCCL communicator over the ranks of `mpi_world` (an MPI world communicator, used to bootstrap), whose
// collectives take device memory of `backend` (a CUDA backend, normally backend_for(cuda,
// local_device_index(*mpi_world))). Collective over mpi_world. Throws dmuon::Error naming the rank when NCCL
// fails (two ranks on one GPU, for instance).
std::shared_ptr<Comm> nccl_world(std::shared_ptr<Comm> mpi_world, Backend& backend);

}  // namespace dmuon::comm
