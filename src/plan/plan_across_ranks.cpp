#include "dmuon/plan_across_ranks.hpp"

#include <cstdint>

namespace dmuon {

Plan plan_across_ranks(comm::Comm& comm, const std::vector<ParamSpec>& params, const std::vector<PlanItem>& items,
                       const PlanOptions& options) {
  Plan plan;
  std::vector<int64_t> owners(params.size(), -1);
  if (comm.rank() == 0) {
    plan = make_plan(params, items, comm.size(), options);
    owners.assign(plan.owner.begin(), plan.owner.end());
  }
  comm.broadcast<int64_t>(owners, 0).wait();
  if (comm.rank() != 0) plan = plan_from_owners(params, items, comm.size(), {owners.begin(), owners.end()}, options);
  return plan;
}

}  // namespace dmuon
