#include "dmuon/plan_across_ranks.hpp"

#include <cstdint>
#include <cstring>
#include <string>

#include "dmuon/rank_agreement.hpp"

namespace dmuon {

Plan plan_across_ranks(comm::Comm& comm, const std::vector<ParamSpec>& params, const std::vector<PlanItem>& items,
                       const PlanOptions& options) {
  Plan plan;
  const std::string bytes = comm::from_rank0(
      comm,
      [&] {
        plan = make_plan(params, items, comm.size(), options);
        std::string out(plan.owner.size() * sizeof(int), '\0');
        std::memcpy(out.data(), plan.owner.data(), out.size());
        return out;
      },
      "make the owner plan");
  if (comm.rank() == 0) return plan;
  std::vector<int> owner(bytes.size() / sizeof(int));
  std::memcpy(owner.data(), bytes.data(), owner.size() * sizeof(int));
  return plan_from_owners(params, items, comm.size(), owner, options);
}

}  // namespace dmuon
