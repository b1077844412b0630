// `dmuon plan`: owner assignment of a model's Muon matrices over D ranks, with the predicted
// per-rank NS time and bytes, makespan, lower bound, gap and solve time of each balancer. With --mesh, owners among
// the ranks holding each matrix and, per rank, the bytes step() moves (mesh_args.hpp). With --muon-group rules that
// split matrices for Newton–Schulz (split-heads, split-sizes), a split matrix costs its blocks' times, as
// `dmuon train` plans it.
#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "cli_kit/cli.hpp"
#include "dmuon/plan.hpp"
#include "cli_kit/model_args.hpp"
#include "mesh_args.hpp"
#include "muon_group_args.hpp"
#include "plan_costs.hpp"

namespace dmuon::cli {

namespace plan_command {

struct PlanArgs {
  ModelArgs model;
  int ranks = 0;
  std::string balancer = "all";
  CostArgs costs;
  MeshArgs mesh;
  MuonGroupArgs muon_groups;
  PlanOptions options;
  bool json = false;
};

// A plan's column: its balancer, "+mem" where memory was weighed beside time (--memory-balance).
std::string plan_label(const Plan& p) { return to_string(p.balancer) + (p.memory_balance > 0 ? "+mem" : ""); }

// "7.616B", "494.03M", "36.9k", "1234": a parameter count readable at every size.
std::string count_text(int64_t n) {
  char buf[32];
  if (n >= 1'000'000'000) std::snprintf(buf, sizeof buf, "%.3fB", n / 1e9);
  else if (n >= 1'000'000) std::snprintf(buf, sizeof buf, "%.2fM", n / 1e6);
  else if (n >= 10'000) std::snprintf(buf, sizeof buf, "%.1fk", n / 1e3);
  else std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(n));
  return buf;
}

void print_table(const std::string& title, const std::vector<Plan>& plans) {
  std::printf("%s\n\n", title.c_str());
  std::printf("%6s", "rank");
  for (const auto& p : plans) std::printf(" | %8s ms %10s", plan_label(p).c_str(), "MiB");
  std::printf("\n");
  const int ranks = plans.front().ranks;
  for (int r = 0; r < ranks; ++r) {
    std::printf("%6d", r);
    for (const auto& p : plans) std::printf(" | %11.3f %10.1f", 1e3 * p.per_rank[r].time_s, p.per_rank[r].bytes / 1048576.0);
    std::printf("\n");
  }
  std::printf("\n%-8s %12s %14s %8s %9s %11s %7s  %s\n", "balancer", "makespan_ms", "lower_bound_ms", "gap_%",
              "solve_s", "max_MiB", "mem_ok", "note");
  for (const auto& p : plans) {
    int64_t max_bytes = 0;
    for (const auto& r : p.per_rank) max_bytes = std::max(max_bytes, r.bytes);
    std::printf("%-8s %12.3f %14.3f %8.2f %9.3f %11.1f %7s  %s%s\n", plan_label(p).c_str(), 1e3 * p.makespan_s,
                1e3 * p.lower_bound_s, p.gap_pct, p.solve_s, max_bytes / 1048576.0, p.memory_ok ? "yes" : "NO",
                p.proven_optimal ? "optimal; " : "", p.note.c_str());
  }
  std::printf("memory bound per rank: %.1f MiB\n", plans.front().memory_cap_bytes / 1048576.0);
}

nlohmann::json to_json(const Plan& p, const std::vector<ParamSpec>& params) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& r : p.per_rank) {
    nlohmann::json batches = nlohmann::json::array();
    for (const auto& b : r.batches) {
      nlohmann::json names = nlohmann::json::array();
      for (int i : b.params) names.push_back(params[i].name);
      batches.push_back({{"rows", b.rows}, {"cols", b.cols}, {"time_s", b.time_s}, {"params", names}});
    }
    ranks.push_back({{"time_s", r.time_s},
                     {"bytes", r.bytes},
                     {"step_sent_bytes", r.step_sent_bytes},
                     {"step_received_bytes", r.step_received_bytes},
                     {"batches", batches}});
  }
  return {{"balancer", to_string(p.balancer)}, {"memory_balance", p.memory_balance},
          {"fell_back", p.fell_back},         {"note", p.note},
          {"makespan_s", p.makespan_s},       {"lower_bound_s", p.lower_bound_s}, {"gap_pct", p.gap_pct},
          {"proven_optimal", p.proven_optimal}, {"solve_s", p.solve_s},       {"memory_cap_bytes", p.memory_cap_bytes},
          {"memory_ok", p.memory_ok},         {"owner", p.owner},             {"per_rank", ranks}};
}

void run(const PlanArgs& a) {
  const std::optional<Mesh> mesh = a.mesh.mesh(a.ranks, "--ranks");
  DMUON_CHECK(mesh || a.ranks > 0, "give --ranks or --mesh");
  const int ranks = mesh ? mesh->ranks() : a.ranks;
  const auto params = a.model.load();
  const std::vector<std::vector<MatrixBlock>> blocks = a.muon_groups.ns_blocks(params);
  const auto split = std::count_if(blocks.begin(), blocks.end(), [](const auto& b) { return b.size() > 1; });
  auto items = make_plan_items(params, ranks, a.costs.batch_time(params, ranks, blocks), blocks);
  if (mesh) lay_out_on_mesh(items, params, *mesh, ranks);
  std::set<std::pair<int64_t, int64_t>> shapes;
  for (const auto& it : items) shapes.insert({it.rows, it.cols});
  std::vector<Balancer> which;
  if (a.balancer == "all") which = {Balancer::rr, Balancer::lpt, Balancer::milp};
  else which = {parse_balancer(a.balancer)};
  std::vector<Plan> plans;
  for (Balancer b : which) {
    PlanOptions o = a.options;
    o.balancer = b;
    o.memory_balance = 0;
    plans.push_back(make_plan(params, items, ranks, o));
    if (a.options.memory_balance > 0) {  // beside it, the same plan with memory weighed (one solve: milp's is timed)
      o.memory_balance = a.options.memory_balance;
      plans.push_back(weigh_memory(params, items, ranks, plans.back(), o));
    }
  }
  if (a.json) {
    nlohmann::json out = {{"model", a.model.label()},      {"ranks", ranks},
                          {"costs", a.costs.describe()},   {"parameters", count_params(params)},
                          {"matrices", items.size()},      {"shapes", shapes.size()},
                          {"split_matrices", split},
                          {"plans", nlohmann::json::array()}};
    if (mesh) out["mesh"] = mesh_json(*mesh);
    for (const auto& p : plans) out["plans"].push_back(to_json(p, params));
    std::printf("%s\n", out.dump(2).c_str());
    return;
  }
  char title[512];
  const std::string split_text = split > 0 ? ", " + std::to_string(split) + " split into blocks" : "";
  std::snprintf(title, sizeof title, "%s: %s parameters, %zu Muon matrices in %zu shapes%s; D = %d; costs: %s",
                a.model.label().c_str(), count_text(count_params(params)).c_str(), items.size(), shapes.size(),
                split_text.c_str(), ranks, a.costs.describe().c_str());
  print_table(title, plans);
  if (mesh) print_mesh_ranks(*mesh, plans);
}

Registration reg("", [](CLI::App& app) {
  auto args = std::make_shared<PlanArgs>();
  auto* c = app.add_subcommand("plan", "Assign Muon matrices to owner ranks and show the predicted balance");
  args->model.add_to(c);
  c->add_option("--ranks", args->ranks, "Number of ranks D (required unless --mesh gives it)")->check(at_least(1));
  args->mesh.add_to(c);
  c->add_option("--balancer", args->balancer, "rr, lpt, milp, or all (side by side)")
      ->capture_default_str()
      ->check(CLI::IsMember({"rr", "lpt", "milp", "all"}));
  args->costs.add_to(c);
  args->muon_groups.add_to(c);
  c->add_option("--memory-slack", args->options.memory_slack, "Memory bound ε: a rank holds ≤ (1+ε)·S/D bytes")
      ->capture_default_str()
      ->check(at_least(0.0));
  c->add_option("--memory-balance", args->options.memory_balance,
                "Weigh memory beside time: let each balancer's makespan grow by up to this fraction to lower the "
                "fullest rank's bytes, shown beside the balancer's plan as <balancer>+mem (0: time alone)")
      ->capture_default_str()
      ->check(at_least(0.0));
  c->add_flag("--spread", args->options.spread_units, "Spread each layer's matrices over distinct owners (milp)");
  c->add_option("--time-limit", args->options.time_limit_s, "CBC time limit in seconds")
      ->capture_default_str()
      ->check(positive());
  c->add_flag("--verbose", args->options.verbose, "Show CBC's log");
  c->add_flag("--json", args->json, "Print JSON instead of tables");
  c->callback([args] { run(*args); });
});

}  // namespace plan_command

}  // namespace dmuon::cli
