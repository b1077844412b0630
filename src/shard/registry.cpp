// Parameter registry and its cross-rank check: all-gather one hash per rank; only on a mismatch
// exchange per-parameter hashes and then the descriptions of the first differing parameter, so
// every rank throws the same message and nobody hangs.
#include <algorithm>
#include <map>
#include <sstream>

#include "dmuon/checksum.hpp"
#include "dmuon/shard.hpp"

namespace dmuon::shard {

namespace {
int64_t hash_spec(const ParamSpec& s) {
  uint64_t h = fnv1a64(s.name);
  const int64_t meta[3] = {static_cast<int64_t>(s.shape.size()), static_cast<int64_t>(s.role), s.unit};
  h = fnv1a64_values(meta, 3, h);
  h = fnv1a64_values(s.shape.data(), s.shape.size(), h);
  return static_cast<int64_t>(h >> 1);
}

std::string describe(const ParamSpec& s) {
  std::ostringstream os;
  os << "'" << s.name << "' shape [";
  for (std::size_t i = 0; i < s.shape.size(); ++i) os << (i ? "x" : "") << s.shape[i];
  os << "] " << to_string(s.role) << " unit " << s.unit;
  return os.str();
}
}  // namespace

int ParamRegistry::add(ParamSpec spec) {
  DMUON_CHECK(!spec.name.empty(), "parameter #", specs_.size(), " has an empty name");
  DMUON_CHECK(find(spec.name) < 0, "parameter '", spec.name, "' is registered twice");
  DMUON_CHECK(!spec.shape.empty(), "parameter '", spec.name, "' has an empty shape");
  for (int64_t d : spec.shape) DMUON_CHECK(d > 0, "parameter '", spec.name, "' has a non-positive dimension ", d);
  DMUON_CHECK(spec.unit >= 0, "parameter '", spec.name, "' has negative unit ", spec.unit);
  specs_.push_back(std::move(spec));
  return size() - 1;
}

int ParamRegistry::num_units() const {
  int n = 0;
  for (const auto& s : specs_) n = std::max(n, s.unit + 1);
  return n;
}

int ParamRegistry::find(std::string_view name) const {
  for (int i = 0; i < size(); ++i)
    if (specs_[i].name == name) return i;
  return -1;
}

void ParamRegistry::verify_across(comm::Comm& comm) const {
  const int n = comm.size();
  std::vector<int64_t> hashes(specs_.size());
  for (std::size_t i = 0; i < specs_.size(); ++i) hashes[i] = hash_spec(specs_[i]);
  const uint64_t total = fnv1a64_values(hashes.data(), hashes.size());
  const int64_t mine[2] = {size(), static_cast<int64_t>(total >> 1)};
  std::vector<int64_t> all(2 * static_cast<std::size_t>(n));
  comm.all_gather<int64_t>(mine, all).wait();
  bool same = true;
  for (int r = 1; r < n; ++r) same = same && all[2 * r] == all[0] && all[2 * r + 1] == all[1];
  if (same) return;

  // Which parameter differs first: every rank sees every rank's per-parameter hashes.
  std::vector<int64_t> counts(n), displ(n + 1, 0);
  for (int r = 0; r < n; ++r) {
    counts[r] = all[2 * r];
    displ[r + 1] = displ[r] + counts[r];
  }
  std::vector<int64_t> every(displ[n]);
  comm.all_gatherv<int64_t>(hashes, every, counts).wait();
  const int64_t longest = *std::max_element(counts.begin(), counts.end());
  auto hash_at = [&](int r, int64_t i) { return i < counts[r] ? every[displ[r] + i] : int64_t{-1}; };
  int64_t first = 0;
  for (; first < longest; ++first) {
    bool differs = false;
    for (int r = 1; r < n; ++r) differs = differs || hash_at(r, first) != hash_at(0, first);
    if (differs) break;
  }

  // Every rank's description of that parameter, grouped by text.
  const std::string text =
      first < size() ? describe(specs_[first]) : "nothing (" + std::to_string(size()) + " parameters registered)";
  const int64_t len = static_cast<int64_t>(text.size());
  std::vector<int64_t> lens(n);
  comm.all_gather<int64_t>(std::span<const int64_t>(&len, 1), lens).wait();
  int64_t all_len = 0;
  for (int64_t l : lens) all_len += l;
  std::vector<uint8_t> texts(all_len);
  comm.all_gatherv<uint8_t>(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size()), texts,
                            lens)
      .wait();
  std::map<std::string, std::vector<int>> ranks_of;
  std::vector<std::string> order;
  for (int r = 0, at = 0; r < n; at += static_cast<int>(lens[r]), ++r) {
    std::string t(reinterpret_cast<const char*>(texts.data()) + at, lens[r]);
    if (!ranks_of.count(t)) order.push_back(t);
    ranks_of[t].push_back(r);
  }
  std::ostringstream os;
  for (const auto& t : order) {
    os << "; rank" << (ranks_of[t].size() > 1 ? "s" : "");
    for (std::size_t i = 0; i < ranks_of[t].size(); ++i) os << (i ? "," : "") << " " << ranks_of[t][i];
    os << " registered " << t;
  }
  DMUON_FAIL("parameter registration differs across ranks at parameter #", first, " (seen on rank ", comm.rank(), ")",
             os.str());
}

}  // namespace dmuon::shard
