// The table of optimizer kinds the generic tests iterate (optimizer_kinds.hpp).
#include "optimizer_kinds.hpp"

#include <algorithm>

namespace dmuon::test {

namespace {
using shard::Mode;
const std::vector<Mode> kEveryMode = {Mode::z3, Mode::z2, Mode::replicated};
const std::vector<TestDevice> kEveryDevice = {TestDevice::cpu, TestDevice::fenced};

std::string identifier(std::string_view text) {
  std::string out(text);
  std::replace(out.begin(), out.end(), '-', '_');
  return out;
}
}  // namespace

const std::vector<KindRow>& optimizer_kinds() {
  static const std::vector<KindRow> rows = {
      // kind                    reference          modes            devices       ranks (0: all)
      {OptimKind::adamw,         OptimKind::adamw,  kEveryMode,      kEveryDevice, 0},
      {OptimKind::muon,          OptimKind::muon,   {Mode::z3},      kEveryDevice, 1},
      {OptimKind::muon_gather,   OptimKind::muon,   kEveryMode,      kEveryDevice, 0},
      {OptimKind::dmuon,         OptimKind::muon,   kEveryMode,      kEveryDevice, 0},
  };
  return rows;
}

bool KindRow::on(TestDevice device) const { return std::find(devices.begin(), devices.end(), device) != devices.end(); }
std::string KindRow::name() const { return identifier(to_string(kind)); }
std::string KindMode::name() const { return row.name() + "_" + identifier(shard::to_string(mode)); }

std::vector<KindMode> kinds_and_modes() {
  std::vector<KindMode> out;
  for (const KindRow& row : optimizer_kinds())
    for (Mode mode : row.modes) out.push_back({row, mode});
  return out;
}

std::vector<KindMode> kinds_and_modes(TestDevice device) {
  std::vector<KindMode> out = kinds_and_modes();
  std::erase_if(out, [&](const KindMode& c) { return !c.row.on(device); });
  return out;
}

std::string kind_name(const ::testing::TestParamInfo<KindRow>& info) { return info.param.name(); }
std::string kind_mode_name(const ::testing::TestParamInfo<KindMode>& info) { return info.param.name(); }
void PrintTo(const KindRow& row, std::ostream* os) { *os << to_string(row.kind); }
void PrintTo(const KindMode& c, std::ostream* os) { *os << to_string(c.row.kind) << " " << shard::to_string(c.mode); }

}  // namespace dmuon::test
