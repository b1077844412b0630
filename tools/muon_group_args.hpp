// The --muon-group option of `dmuon train`, `dmuon plan` and `dmuon simulate`: per-matrix Muon options, repeatable,
// the first matching rule wins (parse_muon_rule; docs/optimizers.md). `dmuon plan` and `dmuon simulate` read the
// splits from it (ns_blocks), to cost a split matrix as its blocks.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "dmuon/error.hpp"
#include "dmuon/optim.hpp"

namespace dmuon::cli {

struct MuonGroupArgs {
  std::vector<std::string> texts;  // --muon-group, in order

  void add_to(CLI::App* c) {
    c->add_option("--muon-group", texts,
                  "per-matrix Muon options, repeatable, the first matching rule wins: 'PATTERN:key=value,...' with "
                  "PATTERN a glob over parameter names (or re:REGEX) and keys ns-steps, coeffs, algo, scale, "
                  "extra-scale, cautious-wd (on|off), variant (muon|normuon), normuon-beta2, split-heads, split-sizes "
                  "(A+B+...), split-dim (0 rows | 1 columns) (docs/optimizers.md); e.g. "
                  "'blocks.*.attn.*:ns-steps=6,variant=normuon' (default: none, every matrix takes Muon's defaults)")
        ->allow_extra_args(false);  // one rule per --muon-group, however many are given
  }

  // The rules, each key not given taken from `defaults`; an error names the option.
  std::vector<MuonRule> rules(const MuonMatrixOptions& defaults) const {
    std::vector<MuonRule> out;
    for (const std::string& text : texts) {
      try {
        out.push_back(parse_muon_rule(text, defaults));
      } catch (const Error& e) {
        DMUON_FAIL("--muon-group: ", e.what());
      }
    }
    return out;
  }

  // Per parameter, the blocks the rules split its Newton–Schulz into (optim.hpp: muon_blocks over Muon's defaults);
  // as make_plan_items and SimOptions take them.
  std::vector<std::vector<MatrixBlock>> ns_blocks(const std::vector<ParamSpec>& params) const {
    OptimizerOptions optimizer;
    optimizer.muon_rules = rules(optimizer.muon);
    return muon_blocks(params, optimizer);
  }
};

}  // namespace dmuon::cli
