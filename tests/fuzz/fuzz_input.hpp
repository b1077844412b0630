// Shared by the fuzz targets (tests/fuzz/fuzz_*.cpp): the input as a file for parsers that read a
// path, and the rule every target checks: bad input ends in a dmuon::Error, nothing else.
//
// A target defines LLVMFuzzerTestOneInput. Built with clang and -fsanitize=fuzzer (make fuzz) it is
// a libFuzzer executable; built with g++ and replay_main.cpp it replays the committed corpus as a
// ctest test (fuzz_replay.<name>), so every CI run re-checks every input the fuzzers kept.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "dmuon/error.hpp"

namespace dmuon::fuzz {

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// A folder of this process's own, removed at exit.
inline const std::string& scratch_dir() {
  struct Scratch {
    std::string path;
    Scratch() : path((std::filesystem::temp_directory_path() / ("dmuon-fuzz-" + std::to_string(::getpid()))).string()) {
      std::filesystem::create_directories(path);
    }
    ~Scratch() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  };
  static const Scratch scratch;
  return scratch.path;
}

// Writes `bytes` to <scratch>/<name> and returns the path.
inline std::string write_scratch(const std::string& name, std::string_view bytes) {
  const std::string path = scratch_dir() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) {
    std::fprintf(stderr, "fuzz harness: cannot write %s\n", path.c_str());
    std::abort();
  }
  return path;
}

// Runs `parse`: a dmuon::Error is the expected answer to bad input; any other exception (a
// std::out_of_range, a bad_alloc from a size taken on trust, a JSON type error) is a finding.
template <typename Parse>
void expect_only_dmuon_errors(Parse&& parse) {
  try {
    parse();
  } catch (const dmuon::Error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz finding: exception other than dmuon::Error: %s\n", e.what());
    std::abort();
  }
}

}  // namespace dmuon::fuzz
