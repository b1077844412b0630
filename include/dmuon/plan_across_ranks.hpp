// Owner plans that every rank agrees on. The planner itself (plan.hpp) is pure, and milp with a
// time limit may answer differently on different ranks, so rank 0 solves and broadcasts the owners.
#pragma once

#include <vector>

#include "dmuon/comm.hpp"
#include "dmuon/plan.hpp"

namespace dmuon {

// Collective. Rank 0 runs make_plan(params, items, comm.size(), options) and broadcasts
// Plan::owner; the other ranks rebuild the plan from it (plan_from_owners), so every rank returns
// the same owners. `params` and `items` must be the same on every rank.
Plan plan_across_ranks(comm::Comm& comm, const std::vector<ParamSpec>& params, const std::vector<PlanItem>& items,
                       const PlanOptions& options);

}  // namespace dmuon
