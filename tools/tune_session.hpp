// Options and steps shared by `dmuon tune` and `dmuon plan --costs measured`: pick the thread count
// and cache file, load the cache (a corrupt or foreign one is a warning), tune what is missing with
// a progress bar on stderr, and save the cache atomically when anything was tuned (tune_with_cache).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "cli.hpp"
#include "device_args.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/tune.hpp"

namespace dmuon::cli {

// Tuning with a progress bar on stderr (redrawn in place; the caller ends the line) and warnings on stderr.
inline TuneSessionOptions session_options(const std::string& cache_path, int threads) {
  TuneSessionOptions o;
  o.cache_path = cache_path;
  o.threads = threads;
  o.progress = [](size_t done, size_t total, const std::string& what) {
    constexpr int kWidth = 30;
    const int filled = total ? static_cast<int>(kWidth * done / total) : kWidth;
    std::fprintf(stderr, "\r[%s%s] %zu/%zu %-48s", std::string(filled, '#').c_str(),
                 std::string(kWidth - filled, '.').c_str(), done, total, what.c_str());
    std::fflush(stderr);
  };
  o.warn = [](const std::string& warning) { std::fprintf(stderr, "dmuon: warning: %s\n", warning.c_str()); };
  return o;
}

struct TuneSessionArgs {
  int threads = 0;  // 0: BLAS's current count
  std::string cache;
  int rounds = 3;
  DeviceArgs device;  // tune on a GPU (dmuon tune --device cuda)

  void add_to(CLI::App* c) {
    c->add_option("--threads", threads, "BLAS threads to tune for (0: the current count)")->check(thread_count());
    c->add_option("--cache", cache, "Tuning cache (default $XDG_CACHE_HOME/dmuon/tune.json or ~/.cache/dmuon/tune.json)");
    c->add_option("--rounds", rounds, "Timing rounds per candidate (minimum kept)")->check(at_least(1));
  }

  int resolved_threads() const { return device.gpu() ? 1 : threads > 0 ? threads : linalg::threads(); }
  std::string cache_path() const { return cache.empty() ? default_tune_cache_path() : cache; }

  std::vector<TuneEntry> tune(const std::vector<TuneRequest>& requests) const {
    const int n = resolved_threads();
    if (!device.gpu()) linalg::set_threads(n);
    TuneSessionOptions o = session_options(cache_path(), n);
    o.rounds = rounds;
    if (device.gpu()) {
      o.backend = &device.backend();
      o.dtype = device.iterates();
    }
    auto entries = tune_with_cache(requests, o);
    std::fprintf(stderr, "\n");
    return entries;
  }
};

}  // namespace dmuon::cli
