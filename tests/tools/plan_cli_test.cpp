// `dmuon plan --muon-group`: the rules that split matrices for Newton–Schulz make the plan cost each split matrix as
// its blocks, as `dmuon train` plans it (make_plan_items with muon_blocks), run as a user runs the command.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dmuon/hardware_profile.hpp"
#include "dmuon/models.hpp"
#include "dmuon/optim.hpp"
#include "dmuon/plan.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

// Qwen2.5-0.5B's attention split by heads of 64: q and o into 14 blocks (o by columns), k and v into 2.
const std::vector<std::string> kHeads = {"*.q_proj.weight:split-heads=14", "*.k_proj.weight:split-heads=2",
                                         "*.v_proj.weight:split-heads=2", "*.o_proj.weight:split-heads=14,split-dim=1"};

// `dmuon plan` on qwen2.5-0.5b at 5 ranks (lpt, flops on h200) with these --muon-group rules: its JSON.
nlohmann::json plan_json(const std::vector<std::string>& rules) {
  std::string command = "timeout 60 " + std::string(DMUON_CLI_PATH) +
                        " plan --model qwen2.5-0.5b --ranks 5 --balancer lpt --costs flops --device h200 --json";
  for (const std::string& rule : rules) command += " --muon-group '" + rule + "'";
  const test::CommandResult r = test::run_command(command);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return nlohmann::json::parse(r.output);
}

// The same plan made here: the blocks of these rules (none: every matrix whole).
std::vector<int> owners_here(const std::vector<std::string>& rules) {
  const std::vector<ParamSpec> params = load_model_manifest("qwen2.5-0.5b");
  OptimizerOptions optimizer;
  for (const std::string& rule : rules) optimizer.muon_rules.push_back(parse_muon_rule(rule, optimizer.muon));
  const std::vector<std::vector<MatrixBlock>> blocks = muon_blocks(params, optimizer);
  PlanOptions options;
  options.balancer = Balancer::lpt;
  return make_plan(params, make_plan_items(params, 5, flop_batch_time(load_hardware_profile("h200")), blocks), 5,
                   options)
      .owner;
}

TEST(PlanCli, MuonGroupSplitsCostAMatrixAsItsBlocks) {
  const nlohmann::json whole = plan_json({}), split = plan_json(kHeads);
  EXPECT_EQ(whole["split_matrices"], 0);
  EXPECT_EQ(split["split_matrices"], 96) << "24 layers' q, k, v and o";
  const std::vector<int> whole_owners = whole["plans"][0]["owner"], split_owners = split["plans"][0]["owner"];
  EXPECT_EQ(whole_owners, owners_here({}));
  EXPECT_EQ(split_owners, owners_here(kHeads));
  EXPECT_NE(split_owners, whole_owners) << "costed as blocks, q and o weigh 7 times k and v, not 49 times";
}

TEST(PlanCli, AMuonGroupThatDoesNotFitIsNamed) {
  const test::CommandResult r = test::run_command("timeout 60 " + std::string(DMUON_CLI_PATH) +
                                                  " plan --model qwen2.5-0.5b --ranks 2 --muon-group "
                                                  "'*.q_proj.weight:split-heads=3'");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("'model.layers.0.self_attn.q_proj.weight' (896x896) has 896 rows, not a multiple of "
                          "split-heads=3"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace dmuon
