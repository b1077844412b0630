// An enum's names as one table, from which both directions are read: to_string and parse cannot
// disagree, and a parse error lists every valid name.
//   constexpr EnumName<Balancer> kBalancerNames[] = {{Balancer::rr, "rr"}, {Balancer::lpt, "lpt"}};
//   name_of(kBalancerNames, Balancer::lpt) == "lpt";  parse_name(kBalancerNames, "balancer", "lpt")
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "dmuon/error.hpp"

namespace dmuon {

template <typename Enum>
struct EnumName {
  Enum value;
  const char* name;
};

// "?" for a value missing from the table (only a cast outside the enum gives one).
template <typename Enum, std::size_t N>
constexpr std::string_view name_of(const EnumName<Enum> (&table)[N], Enum value) {
  for (const auto& entry : table)
    if (entry.value == value) return entry.name;
  return "?";
}

// Throws dmuon::Error "unknown <what> '<text>' (valid: a, b, c)".
template <typename Enum, std::size_t N>
Enum parse_name(const EnumName<Enum> (&table)[N], std::string_view what, std::string_view text) {
  std::string valid;
  for (const auto& entry : table) {
    if (text == entry.name) return entry.value;
    valid += (valid.empty() ? "" : ", ") + std::string(entry.name);
  }
  DMUON_FAIL("unknown ", what, " '", text, "' (valid: ", valid, ")");
}

}  // namespace dmuon
