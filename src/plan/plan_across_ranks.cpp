#include "dmuon/plan_across_ranks.hpp"

#include <cstdint>
#include <exception>
#include <string>

namespace dmuon {

Plan plan_across_ranks(comm::Comm& comm, const std::vector<ParamSpec>& params, const std::vector<PlanItem>& items,
                       const PlanOptions& options) {
  // Broadcast: [status, owners...]. status −1: the owners follow; status L ≥ 0: rank 0 failed, and
  // a second broadcast carries its error message (L bytes), so no rank waits for a plan that
  // never comes and every rank's error says why.
  Plan plan;
  std::vector<int64_t> message(1 + params.size(), -1);
  std::exception_ptr failure;
  std::string error;
  if (comm.rank() == 0) {
    try {
      plan = make_plan(params, items, comm.size(), options);
      for (std::size_t p = 0; p < params.size(); ++p) message[1 + p] = plan.owner.at(p);
    } catch (const std::exception& e) {
      failure = std::current_exception();
      error = e.what();
      message[0] = static_cast<int64_t>(error.size());
    }
  }
  comm.broadcast<int64_t>(message, 0).wait();
  if (message[0] >= 0) {
    error.resize(static_cast<std::size_t>(message[0]));
    comm.broadcast<uint8_t>(std::span<uint8_t>(reinterpret_cast<uint8_t*>(error.data()), error.size()), 0).wait();
    if (failure) std::rethrow_exception(failure);
    DMUON_FAIL("rank ", comm.rank(), ": rank 0 could not make the owner plan: ", error);
  }
  if (comm.rank() != 0)
    plan = plan_from_owners(params, items, comm.size(), {message.begin() + 1, message.end()}, options);
  return plan;
}

}  // namespace dmuon
