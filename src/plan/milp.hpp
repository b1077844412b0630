// The MILP balancer (CBC); internal to src/plan. See plan.hpp for the contract.
#pragma once

#include <string>
#include <vector>

#include "dmuon/plan.hpp"

namespace dmuon::detail {

struct MilpResult {
  std::vector<int> assignment;  // rank per item; empty when CBC found no solution
  bool proven_optimal = false;
  std::string status;           // for Plan::note
};

// Minimises the makespan subject to the memory cap (and unit spread when asked), starting from
// `warm_start` (rank per item; used only if it satisfies every constraint).
MilpResult balance_milp(const std::vector<PlanItem>& items, int ranks, int64_t memory_cap_bytes,
                        const std::vector<int>& warm_start, double lower_bound_s, const PlanOptions& options);

}  // namespace dmuon::detail
