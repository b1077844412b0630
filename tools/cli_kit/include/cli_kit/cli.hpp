// Subcommand registry of the dmuon CLI: each tools/*.cpp file (and, in dmuon-bench, each bench/commands/*.cpp
// file) adds its subcommand with a static Registration, so main.cpp never changes when a subcommand is added.
#pragma once

#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>

namespace dmuon::cli {

// Adds a subcommand to `app` (the root, or a group such as `ckpt`) and sets its callback.
using AddSubcommand = std::function<void(CLI::App& parent)>;

struct Registration {
  // group: "" for a top-level subcommand, or a group name ("ckpt") created on first use.
  Registration(std::string group, AddSubcommand add);
};

// The executable built on main.cpp and its registry: dmuon (tools/program.cpp) or the benchmarks' dmuon-bench
// (bench/commands/program.cpp), which `dmuon bench` runs.
struct Program {
  const char* name;
  const char* description;
};
extern const Program kProgram;

// Called by main(): adds every registered subcommand.
void add_registered_subcommands(CLI::App& app);

// Thrown by a subcommand to leave with this exit status once everything is cleaned up (main.cpp), e.g.
// `dmuon train` stopped by a signal after a complete step (kStoppedExitCode, tools/stop_signals.hpp).
struct ExitStatus {
  int code;
};

// Called by main() once every option exists: integer options read "010" as ten, not octal 8.
void read_integers_as_decimal(CLI::App& app);

// Range checks for numeric options. CLI11 prefixes the flag, so a bad value reads
// "--iters: must be at least 1, got 0". Values must parse as T (base 10, no overflow) and floating-point
// ones be finite.
// `exclusive_min`: the value must be above `min` ("must be greater than 0").
template <typename T>
CLI::Validator in_range(T min, T max, bool exclusive_min = false) {
  static_assert(std::is_arithmetic_v<T>);
  const auto show = [](T x) {
    std::ostringstream os;
    os << x;
    return os.str();
  };
  const bool unbounded = max == std::numeric_limits<T>::max();
  // For --help: "INT:in [1, inf)=20".
  const std::string range = std::string("in ") + (exclusive_min ? "(" : "[") + show(min) + ", " +
                            (unbounded ? "inf)" : show(max) + "]");
  const std::string must =
      exclusive_min ? "must be greater than " + show(min) + (unbounded ? "" : " and at most " + show(max))
                    : (unbounded ? "must be at least " + show(min) : "must be between " + show(min) + " and " + show(max));
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        // from_chars, not CLI11's strtoll: an out-of-range integer is an error, not the type's maximum.
        T v{};
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), v);
        if (error == std::errc::result_out_of_range) return "out of range, got " + text;
        if (error != std::errc() || end != text.data() + text.size())
          return std::string(std::is_unsigned_v<T>   ? "expected a non-negative integer"
                             : std::is_integral_v<T> ? "expected an integer"
                                                     : "expected a number") +
                 ", got '" + text + "'";
        if constexpr (std::is_floating_point_v<T>)
          if (!std::isfinite(v)) return "must be a finite number, got " + text;
        const bool ok = v <= max && (exclusive_min ? v > min : v >= min);
        return ok ? std::string() : must + ", got " + text;
      },
      range, "RANGE");
}

// The value must be at least `min` ("--steps: must be at least 1, got 0").
template <typename T>
CLI::Validator at_least(T min) {
  return in_range(min, std::numeric_limits<T>::max());
}

// A floating-point value that must be finite and above 0 ("--time-limit: must be greater than 0, got 0").
inline CLI::Validator positive() { return in_range(0.0, std::numeric_limits<double>::max(), true); }

// BLAS thread counts: 0 means "the current setting"; more than this is a typo, not a machine.
constexpr int kMaxThreads = 1024;
inline CLI::Validator thread_count() { return in_range(0, kMaxThreads); }

// The --tune-cache option's help, the same on every subcommand that tunes.
inline constexpr const char* kTuneCacheHelp =
    "Tuning cache file (default $XDG_CACHE_HOME/dmuon/tune.json, else ~/.cache/dmuon/tune.json)";

// --tune and --no-tune setting `tune` (on by default), as two flags so that --help reads
// "--tune  ... (the default)" and "--no-tune  ..." (CLI11 shows "--tune,!--no-tune" as "--tune,--no-tune{false}").
inline void add_tune_flags(CLI::App* c, bool& tune, const std::string& what) {
  tune = true;
  c->add_flag_callback("--tune", [&tune] { tune = true; }, what + "; the default");
  c->add_flag_callback("--no-tune", [&tune] { tune = false; }, "turn --tune off: untuned NS kernels, flop-estimated costs");
}

}  // namespace dmuon::cli
