// Owner plans that every rank agrees on. The planner itself (plan.hpp) is pure, and milp with a time
// limit may answer differently on different ranks, so rank 0 solves and broadcasts the owners
// (comm::from_rank0). Tuned NS entries are agreed on the same way: tune.hpp's tune_across_ranks.
#pragma once

#include <vector>

#include "dmuon/comm.hpp"
#include "dmuon/plan.hpp"

namespace dmuon {

// Collective. Rank 0 runs make_plan(params, items, comm.size(), options) and broadcasts
// Plan::owner; the other ranks rebuild the plan from it (plan_from_owners), so every rank returns
// the same owners and per-rank figures. `params` and `items` must be the same on every rank.
// The balancer's own record (Plan::note, fell_back, solve_s, and proven_optimal where CBC proved
// it) is rank 0's, on rank 0 only; the other ranks hold what plan_from_owners computes from the
// owners (empty note, fell_back false, solve_s 0).
// If make_plan throws on rank 0, rank 0 rethrows its error and every other rank throws an Error
// carrying rank 0's message ("rank 0 could not make the owner plan: ..."); no rank waits.
Plan plan_across_ranks(comm::Comm& comm, const std::vector<ParamSpec>& params, const std::vector<PlanItem>& items,
                       const PlanOptions& options);

}  // namespace dmuon
