// Errors: the library throws dmuon::Error carrying what went wrong and where (file:line of the
// check, plus whatever the message names: parameter, shape, rank, file). Only the CLI turns an
// Error into a message and an exit code.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace dmuon {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Args>
[[noreturn]] void throw_error(const char* file, int line, const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  os << " [" << file << ":" << line << "]";
  throw Error(os.str());
}
}  // namespace detail

}  // namespace dmuon

// DMUON_CHECK(cond, "parameter ", name, " has shape ", r, "x", c) throws dmuon::Error when cond is false.
#define DMUON_CHECK(cond, ...)                                         \
  do {                                                                 \
    if (!(cond)) ::dmuon::detail::throw_error(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

#define DMUON_FAIL(...) ::dmuon::detail::throw_error(__FILE__, __LINE__, __VA_ARGS__)
