// Per-matrix Muon options by name (optim.hpp: MuonRule): their names and the text form of `dmuon train
// --muon-group`, "PATTERN:key=value[,key=value...]".
#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <string>
#include <utility>

#include "dmuon/error.hpp"
#include "dmuon/optim.hpp"

namespace dmuon {

namespace {

constexpr std::array<std::pair<MuonScale, const char*>, 4> kScaleNames = {{{MuonScale::original, "original"},
                                                                           {MuonScale::match_rms_adamw, "match_rms_adamw"},
                                                                           {MuonScale::spectral, "spectral"},
                                                                           {MuonScale::unit_rms, "unit_rms"}}};
constexpr std::array<std::pair<MuonVariant, const char*>, 2> kVariantNames = {
    {{MuonVariant::muon, "muon"}, {MuonVariant::normuon, "normuon"}}};

template <class Names, class T>
std::string name_in(const Names& names, T value) {
  for (const auto& [v, name] : names)
    if (v == value) return name;
  return "?";
}

template <class Names>
auto parse_in(const Names& names, const char* what, const std::string& text) {
  std::string valid;
  for (const auto& [v, name] : names) {
    if (text == name) return v;
    valid += (valid.empty() ? "" : ", ") + std::string(name);
  }
  DMUON_FAIL("unknown ", what, " '", text, "' (valid: ", valid, ")");
}

// The whole of `text` as a number, else an error naming the key.
template <class T>
T number(const std::string& key, const std::string& text) {
  T value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  DMUON_CHECK(ec == std::errc() && end == text.data() + text.size() && !text.empty(), key, "=", text,
              " is not a number");
  return value;
}

std::string number_text(double v) {
  char buf[32];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
}

constexpr const char* kKeys =
    "ns-steps, coeffs, algo, scale, extra-scale, cautious-wd, variant, normuon-beta2, split-heads, split-sizes, "
    "split-dim";

// "896+128+128" as lengths ≥ 1, at least two.
std::vector<int64_t> parse_sizes(const std::string& value) {
  std::vector<int64_t> sizes;
  size_t start = 0;
  while (start <= value.size()) {
    const size_t end = std::min(value.find('+', start), value.size());
    sizes.push_back(number<int64_t>("split-sizes", value.substr(start, end - start)));
    DMUON_CHECK(sizes.back() >= 1, "split-sizes must be lengths ≥ 1, got ", value);
    start = end + 1;
  }
  DMUON_CHECK(sizes.size() >= 2, "split-sizes needs two or more lengths joined by '+', got ", value);
  return sizes;
}

std::string sizes_text(const std::vector<int64_t>& sizes) {
  std::string text;
  for (int64_t s : sizes) text += (text.empty() ? "" : "+") + std::to_string(s);
  return text;
}

void set_option(MuonMatrixOptions& o, const std::string& key, const std::string& value) {
  if (key == "ns-steps") {
    o.ns.steps = number<int>(key, value);
    DMUON_CHECK(o.ns.steps >= 1, "ns-steps must be ≥ 1, got ", value);
  } else if (key == "coeffs") {
    o.ns.coeffs = parse_ns_coeffs(value);
  } else if (key == "algo") {
    o.ns.algo = parse_ns_algo(value);
  } else if (key == "scale") {
    o.scale = parse_muon_scale(value);
  } else if (key == "extra-scale") {
    o.extra_scale_factor = number<double>(key, value);
    DMUON_CHECK(std::isfinite(o.extra_scale_factor) && o.extra_scale_factor > 0, "extra-scale must be > 0, got ",
                value);
  } else if (key == "cautious-wd") {
    DMUON_CHECK(value == "on" || value == "off", "cautious-wd takes on or off, got '", value, "'");
    o.cautious_wd = value == "on";
  } else if (key == "variant") {
    o.variant = parse_muon_variant(value);
  } else if (key == "normuon-beta2") {
    o.normuon_beta2 = number<double>(key, value);
    DMUON_CHECK(o.normuon_beta2 >= 0 && o.normuon_beta2 < 1, "normuon-beta2 must be in [0, 1), got ", value);
  } else if (key == "split-heads") {
    o.split_heads = number<int64_t>(key, value);
    DMUON_CHECK(o.split_heads >= 0, "split-heads must be ≥ 1 (0: no split), got ", value);
  } else if (key == "split-sizes") {
    o.split_sizes = parse_sizes(value);
  } else if (key == "split-dim") {
    DMUON_CHECK(value == "0" || value == "1", "split-dim takes 0 (rows) or 1 (columns), got '", value, "'");
    o.split_dim = value == "1";
  } else {
    DMUON_FAIL("unknown option '", key, "' (valid: ", kKeys, ")");
  }
}

}  // namespace

std::string to_string(MuonScale scale) { return name_in(kScaleNames, scale); }
std::string to_string(MuonVariant variant) { return name_in(kVariantNames, variant); }
MuonScale parse_muon_scale(const std::string& name) { return parse_in(kScaleNames, "Muon scale", name); }
MuonVariant parse_muon_variant(const std::string& name) { return parse_in(kVariantNames, "Muon variant", name); }

std::vector<MatrixBlock> muon_blocks(int64_t rows, int64_t cols, const MuonMatrixOptions& o, const std::string& name) {
  if (o.split_heads == 0 && o.split_sizes.empty()) return {{0, 0, rows, cols}};
  const bool by_rows = o.split_dim == 0;
  const int64_t length = by_rows ? rows : cols;
  const char* what = by_rows ? " rows" : " columns";
  std::vector<int64_t> sizes = o.split_sizes;
  if (o.split_heads > 0) {
    DMUON_CHECK(length % o.split_heads == 0, "Muon matrix '", name, "' (", rows, "x", cols, ") has ", length, what,
                ", not a multiple of split-heads=", o.split_heads);
    sizes.assign(static_cast<size_t>(o.split_heads), length / o.split_heads);
  }
  int64_t sum = 0;
  for (int64_t s : sizes) sum += s;
  DMUON_CHECK(sum == length, "Muon matrix '", name, "' (", rows, "x", cols, ") has ", length, what,
              ", but split-sizes ", sizes_text(sizes), " sum to ", sum);
  std::vector<MatrixBlock> blocks;
  int64_t start = 0;
  for (int64_t s : sizes) {
    blocks.push_back(by_rows ? MatrixBlock{start, 0, s, cols} : MatrixBlock{0, start, rows, s});
    start += s;
  }
  return blocks;
}

MuonRule parse_muon_rule(const std::string& text, const MuonMatrixOptions& defaults) {
  const size_t colon = text.rfind(':');
  const std::string pattern = colon == std::string::npos ? "" : text.substr(0, colon);
  DMUON_CHECK(colon != std::string::npos && !pattern.empty() && colon + 1 < text.size(), "Muon rule '", text,
              "' is not PATTERN:key=value[,key=value...] (keys: ", kKeys, ")");
  MuonRule rule{pattern, defaults};
  const std::string list = text.substr(colon + 1);
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(',', start), list.size());
    const std::string item = list.substr(start, end - start);
    const size_t eq = item.find('=');
    try {
      DMUON_CHECK(eq != std::string::npos && eq > 0, "'", item, "' is not key=value");
      set_option(rule.options, item.substr(0, eq), item.substr(eq + 1));
    } catch (const Error& e) {
      DMUON_FAIL("Muon rule '", text, "' (pattern '", pattern, "'): ", e.what());
    }
    start = end + 1;
  }
  DMUON_CHECK(rule.options.split_heads == 0 || rule.options.split_sizes.empty(), "Muon rule '", text,
              "': split-heads and split-sizes are two ways of one split: set one");
  return rule;
}

std::string to_string(const MuonRule& rule, const MuonMatrixOptions& defaults) {
  const MuonMatrixOptions& o = rule.options;
  std::string list;
  const auto add = [&](bool differs, const std::string& item) {
    if (differs) list += (list.empty() ? "" : ",") + item;
  };
  add(o.ns.steps != defaults.ns.steps, "ns-steps=" + std::to_string(o.ns.steps));
  add(o.ns.coeffs != defaults.ns.coeffs, "coeffs=" + to_string(o.ns.coeffs));
  add(o.ns.algo != defaults.ns.algo, "algo=" + to_string(o.ns.algo));
  add(o.scale != defaults.scale, "scale=" + to_string(o.scale));
  add(o.extra_scale_factor != defaults.extra_scale_factor, "extra-scale=" + number_text(o.extra_scale_factor));
  add(o.cautious_wd != defaults.cautious_wd, std::string("cautious-wd=") + (o.cautious_wd ? "on" : "off"));
  add(o.variant != defaults.variant, "variant=" + to_string(o.variant));
  add(o.normuon_beta2 != defaults.normuon_beta2, "normuon-beta2=" + number_text(o.normuon_beta2));
  add(o.split_heads != defaults.split_heads, "split-heads=" + std::to_string(o.split_heads));
  add(o.split_sizes != defaults.split_sizes, "split-sizes=" + sizes_text(o.split_sizes));
  add(o.split_dim != defaults.split_dim, "split-dim=" + std::to_string(o.split_dim));
  return rule.pattern + ":" + list;
}

}  // namespace dmuon
