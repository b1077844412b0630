// The names of the sharding modes (include/dmuon/shard.hpp: shard::Mode), read and written from one table.
#include "dmuon/shard.hpp"
#include "io/enum_names.hpp"

namespace dmuon::shard {

namespace {
constexpr EnumName<Mode> kModeNames[] = {{Mode::z3, "z3"}, {Mode::z2, "z2"}, {Mode::replicated, "replicated"}};
}  // namespace

std::string_view to_string(Mode mode) { return name_of(kModeNames, mode); }
Mode parse_mode(std::string_view text) { return parse_name(kModeNames, "shard mode", text); }

}  // namespace dmuon::shard
