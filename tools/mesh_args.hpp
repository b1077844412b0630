// The --mesh option of `dmuon plan` and `dmuon simulate` (plan_mesh.hpp), and what they show for it: per rank, its
// mesh coordinate, predicted NS time, and the bytes step() sends and receives.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dmuon/error.hpp"
#include "dmuon/plan.hpp"
#include "dmuon/plan_mesh.hpp"

namespace dmuon::cli {

struct MeshArgs {
  std::string text;  // empty: no mesh

  CLI::Option* add_to(CLI::App* c) {
    return c->add_option("--mesh", text,
                         "Parallel mesh dp_replicate x dp_shard x tp x ep, e.g. 1x2x2x1 (default: none: owners on any "
                         "rank, no step() bytes); owners are chosen among the ranks that hold each matrix");
  }

  // The mesh, if given; `ranks` given by `ranks_option` (0: not given) must be its product. Errors name --mesh.
  std::optional<Mesh> mesh(int ranks, const std::string& ranks_option) const {
    if (text.empty()) return std::nullopt;
    Mesh m;
    try {
      m = parse_mesh(text);
    } catch (const Error& e) {
      throw Error(std::string("--mesh: ") + e.what());
    }
    DMUON_CHECK(ranks == 0 || ranks == m.ranks(), "--mesh ", text, " has ", m.ranks(), " ranks but ", ranks_option,
                " is ", ranks);
    return m;
  }
};

// Per rank: coordinate (replicate, shard, expert, slice), then per plan its NS ms and step() MiB sent / received.
inline void print_mesh_ranks(const Mesh& mesh, const std::vector<Plan>& plans) {
  std::printf("\nper rank on mesh %s (dp_replicate x dp_shard x tp x ep): NS time and the bytes step() moves in the "
              "all-to-all mode\n\n%6s %9s",
              mesh.text().c_str(), "rank", "r,s,e,t");
  for (const auto& p : plans) std::printf(" | %8s ms %9s %9s", to_string(p.balancer).c_str(), "sent MiB", "recv MiB");
  std::printf("\n");
  for (int r = 0; r < mesh.ranks(); ++r) {
    const MeshCoordinate c = coordinate_of(mesh, r);
    const std::string coordinate = std::to_string(c.replicate) + "," + std::to_string(c.shard) + "," +
                                   std::to_string(c.expert) + "," + std::to_string(c.slice);
    std::printf("%6d %9s", r, coordinate.c_str());
    for (const auto& p : plans) {
      const RankPlan& rp = p.per_rank[r];
      std::printf(" | %11.3f %9.1f %9.1f", 1e3 * rp.time_s, rp.step_sent_bytes / 1048576.0,
                  rp.step_received_bytes / 1048576.0);
    }
    std::printf("\n");
  }
}

inline nlohmann::json mesh_json(const Mesh& mesh) {
  return {{"dp_replicate", mesh.dp_replicate}, {"dp_shard", mesh.dp_shard}, {"tp", mesh.tp}, {"ep", mesh.ep},
          {"ranks", mesh.ranks()}};
}

}  // namespace dmuon::cli
