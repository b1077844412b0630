// The sections of docs/BENCHMARKS.md (dmuon-bench-report), each reading its files from the raw output
// folder and writing its part of the document; a missing input gives a note in place of the section.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "document.hpp"

namespace dmuon::bench_report {

// measured.cpp: the title, the machine and the definitions; sections 1-3, measured on this machine.
void introduction(Report& r, const Inputs& in, const std::optional<Value>& first_optimizer_run);
void optimizer_section(Report& r, const Inputs& in, const OptimizerRuns& runs);  // 1. the optimizer step
void ablation_section(Report& r, const Inputs& in);                            // 2. DMuon with a part removed
void e2e_section(Report& r, const Inputs& in);                                 // 3. GPT training steps

// validation.cpp: 4. the this-cpu profile, and the simulator against sections 1 and 3.
void validation_section(Report& r, const Inputs& in, const OptimizerRuns& runs);

// clusters.cpp: section `number` (5, 6): one model on simulated clusters of 8-256 A800s; its simulation, if
// it ran. Then the last section: how the simulated clusters differ from the paper's measurements.
std::optional<Value> cluster_section(Report& r, const Inputs& in, int number, const std::string& name,
                                     const std::string& title, const std::string& plot);
void paper_comparison(Report& r, const std::vector<std::pair<std::string, Value>>& sims);

}  // namespace dmuon::bench_report
