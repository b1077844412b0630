#include "io/json_file.hpp"

#include "dmuon/atomic_file.hpp"

namespace dmuon {

nlohmann::json parse_json(const std::string& text, const std::string& origin) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    DMUON_FAIL(origin, ": not valid JSON (", e.what(), ")");
  }
}

nlohmann::json read_json_file(const std::string& path) { return parse_json(read_file(path), path); }

}  // namespace dmuon
