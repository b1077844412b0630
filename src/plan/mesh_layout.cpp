// What a mesh puts where (plan_mesh.hpp) and what step() moves for an owner (plan.hpp: candidate_owners,
// add_step_bytes).
#include <algorithm>
#include <charconv>
#include <iterator>
#include <set>
#include <string>
#include <utility>

#include "dmuon/error.hpp"
#include "dmuon/plan.hpp"
#include "dmuon/plan_mesh.hpp"

namespace dmuon {

namespace {

constexpr const char* kDimNames[] = {"dp_replicate", "dp_shard", "tp", "ep"};

// torch.chunk(n, parts)'s piece `index`: pieces of ceil(n/parts), the last ones shorter or empty.
int64_t chunk_size(int64_t n, int parts, int index) {
  const int64_t chunk = (n + parts - 1) / parts;
  return std::clamp<int64_t>(n - index * chunk, 0, chunk);
}

// For "layers.3.mlp.experts.7.up_proj.weight": the name without its expert index ("layers.3.mlp.experts..up_proj
// .weight") and the index; nullopt-like {"", -1} for a name without one.
std::pair<std::string, int> expert_of(const std::string& name) {
  static constexpr std::string_view kMark = ".experts.";
  const size_t at = name.find(kMark);
  if (at == std::string::npos) return {"", -1};
  const size_t begin = at + kMark.size();
  const size_t end = name.find('.', begin);
  if (end == std::string::npos || end == begin) return {"", -1};
  int index = -1;
  const auto [ptr, ec] = std::from_chars(name.data() + begin, name.data() + end, index);
  if (ec != std::errc() || ptr != name.data() + end) return {"", -1};
  return {name.substr(0, begin) + name.substr(end), index};
}

}  // namespace

int Mesh::ranks() const { return dp_replicate * dp_shard * tp * ep; }

std::string Mesh::text() const {
  return std::to_string(dp_replicate) + "x" + std::to_string(dp_shard) + "x" + std::to_string(tp) + "x" +
         std::to_string(ep);
}

Mesh parse_mesh(std::string_view text) {
  std::vector<std::string_view> fields;
  for (size_t begin = 0;;) {
    const size_t end = text.find('x', begin);
    fields.push_back(text.substr(begin, end == std::string_view::npos ? std::string_view::npos : end - begin));
    if (end == std::string_view::npos) break;
    begin = end + 1;
  }
  DMUON_CHECK(fields.size() == 4, "mesh '", text, "' has ", fields.size(),
              fields.size() == 1 ? " size" : " sizes", "; it needs four, dp_replicate x dp_shard x tp x ep (e.g. 1x2x2x1)");
  int sizes[4] = {0, 0, 0, 0};
  for (int d = 0; d < 4; ++d) {
    const std::string_view field = fields[d];
    const auto [ptr, ec] = std::from_chars(field.data(), field.data() + field.size(), sizes[d]);
    DMUON_CHECK(!field.empty() && ec == std::errc() && ptr == field.data() + field.size(), "mesh '", text, "': ",
                kDimNames[d], " '", field, "' is not a whole number (the mesh is dp_replicate x dp_shard x tp x ep)");
    DMUON_CHECK(sizes[d] >= 1, "mesh '", text, "': ", kDimNames[d], " must be at least 1, got ", sizes[d]);
  }
  return {sizes[0], sizes[1], sizes[2], sizes[3]};
}

MeshCoordinate coordinate_of(const Mesh& mesh, int rank) {
  MeshCoordinate c;
  c.slice = rank % mesh.tp;
  rank /= mesh.tp;
  c.expert = rank % mesh.ep;
  rank /= mesh.ep;
  c.shard = rank % mesh.dp_shard;
  c.replicate = rank / mesh.dp_shard;
  return c;
}

std::vector<int64_t> held_on_mesh(const Mesh& mesh, const std::vector<ParamSpec>& params, int param) {
  const ParamSpec& p = params.at(param);
  const int64_t rows = p.rows(), cols = p.cols();
  std::vector<int64_t> held(mesh.ranks(), 0);
  const auto [family, index] = expert_of(p.name);
  if (index < 0) {  // dense: tp slices of rows, each slice's rows over the dp_shard·ep ranks of that slice
    for (int g = 0; g < mesh.ranks(); ++g) {
      const MeshCoordinate c = coordinate_of(mesh, g);
      const int64_t slice_rows = chunk_size(rows, mesh.tp, c.slice);
      held[g] = chunk_size(slice_rows, mesh.dp_shard * mesh.ep, c.shard * mesh.ep + c.expert) * cols;
    }
    return held;
  }
  // An expert: its position among the experts of its family, cut over ep as a stack's dim 0.
  std::set<int> family_indices;
  for (const auto& q : params) {
    const auto [f, i] = expert_of(q.name);
    if (i >= 0 && f == family) family_indices.insert(i);
  }
  const int n = static_cast<int>(family_indices.size());
  const int position = static_cast<int>(std::distance(family_indices.begin(), family_indices.find(index)));
  const int per_coordinate = (n + mesh.ep - 1) / mesh.ep;
  for (int g = 0; g < mesh.ranks(); ++g) {
    const MeshCoordinate c = coordinate_of(mesh, g);
    if (c.expert != position / per_coordinate) continue;
    held[g] = chunk_size(rows, mesh.dp_shard * mesh.tp, c.shard * mesh.tp + c.slice) * cols;
  }
  return held;
}

void lay_out_on_mesh(std::vector<PlanItem>& items, const std::vector<ParamSpec>& params, const Mesh& mesh,
                     int ranks) {
  DMUON_CHECK(mesh.ranks() == ranks, "mesh ", mesh.text(), " has ", mesh.ranks(), " ranks, not ", ranks);
  for (auto& it : items) {
    it.held = held_on_mesh(mesh, params, it.param);
    it.replicas = mesh.dp_replicate;
  }
}

std::vector<int> candidate_owners(const PlanItem& item, int ranks) {
  std::vector<int> out;
  for (int r = 0; r < ranks; ++r)
    if (item.held.empty() || item.held[r] > 0) out.push_back(r);
  return out;
}

void add_step_bytes(const PlanItem& item, int owner, std::vector<int64_t>& sent, std::vector<int64_t>& received) {
  if (item.held.empty()) return;
  const int ranks = static_cast<int>(item.held.size());
  const int per_replica = ranks / item.replicas;
  constexpr int64_t kBytes = sizeof(float);
  for (int g = 0; g < ranks; ++g) {
    const int64_t piece = kBytes * item.held[g];
    if (g == owner || piece == 0) continue;
    if (g / per_replica == owner / per_replica) {  // its piece of U to the owner
      sent[g] += piece;
      received[owner] += piece;
    }
    sent[owner] += piece;  // its piece of O back
    received[g] += piece;
  }
}

}  // namespace dmuon
