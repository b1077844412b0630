// Reading JSON with errors that name the file and the key: "<file>: not valid JSON (...)",
// "<file>: <what> lacks a valid '<key>'". Private to the library and the CLI (nlohmann stays out of the
// public headers).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "dmuon/error.hpp"

namespace dmuon {

// `text` parsed; `origin` (a file, or "<file> component 2") names it in the error.
nlohmann::json parse_json(const std::string& text, const std::string& origin);
// The file at `path` parsed; throws dmuon::Error naming it when it cannot be read or is not JSON.
nlohmann::json read_json_file(const std::string& path);

// j[key] as T, or an error naming the file, what was being read ("the index", "a slice") and the key.
template <typename T>
T json_field(const nlohmann::json& j, const char* key, const std::string& path, const std::string& what) {
  try {
    return j.at(key).get<T>();
  } catch (const nlohmann::json::exception&) {
    DMUON_FAIL(path, ": ", what, " lacks a valid '", key, "'");
  }
}

}  // namespace dmuon
