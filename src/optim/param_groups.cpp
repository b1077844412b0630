// Name patterns that move parameters between the Muon and AdamW groups (see GroupRule).
#include <regex>

#include "dmuon/error.hpp"
#include "dmuon/optim.hpp"

namespace dmuon {

namespace {
// A glob as an ECMAScript regex: `*` → `.*`, `?` → `.`, every other character literal.
std::string glob_to_regex(const std::string& glob) {
  std::string re;
  for (char c : glob) {
    if (c == '*') {
      re += ".*";
    } else if (c == '?') {
      re += '.';
    } else {
      if (std::string_view("\\^$.|+()[]{}").find(c) != std::string_view::npos) re += '\\';
      re += c;
    }
  }
  return re;
}
}  // namespace

bool name_matches(const std::string& pattern, const std::string& name) {
  const bool is_regex = pattern.rfind("re:", 0) == 0;
  const std::string re = is_regex ? pattern.substr(3) : glob_to_regex(pattern);
  try {
    return std::regex_match(name, std::regex(re, std::regex::ECMAScript));
  } catch (const std::regex_error& e) {
    DMUON_FAIL("parameter group pattern '", pattern, "' is not a valid regular expression: ", e.what());
  }
}

}  // namespace dmuon
