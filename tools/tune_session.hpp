// Options and steps shared by `dmuon tune` and `dmuon plan --costs measured`: pick the thread count
// and cache file, load the cache (a corrupt or foreign one is a warning), tune what is missing with
// progress on stderr (--progress), and save the cache atomically when anything was tuned (tune_with_cache).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli_kit/cli.hpp"
#include "cli_kit/device_args.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "console/progress.hpp"
#include "dmuon/tune.hpp"

namespace dmuon::cli {

// Tuning with progress on stderr (`bar`, which the caller finishes) and one-line warnings on stderr.
inline TuneSessionOptions session_options(const std::string& cache_path, int threads,
                                          const std::shared_ptr<CountProgress>& bar) {
  TuneSessionOptions o;
  o.cache_path = cache_path;
  o.threads = threads;
  o.progress = [bar](size_t done, size_t total, const std::string& what) { bar->update(done, total, what); };
  o.warn = [bar](const std::string& warning) {
    bar->finish();
    std::fprintf(stderr, "dmuon: warning: %s\n", warning.c_str());
  };
  return o;
}

struct TuneSessionArgs {
  int threads = 0;  // 0: BLAS's current count
  std::string cache;
  int rounds = 3;
  std::string progress = "auto";
  DeviceArgs device;  // tune on a GPU (dmuon tune --device cuda)

  void add_to(CLI::App* c) {
    c->add_option("--threads", threads, "BLAS threads to tune for (0: the current count)")
        ->capture_default_str()
        ->check(thread_count());
    c->add_option("--tune-cache", cache, kTuneCacheHelp);
    c->add_option("--rounds", rounds, "Timing rounds per candidate (minimum kept)")
        ->capture_default_str()
        ->check(at_least(1));
    c->add_option("--progress", progress, "Tuning progress on stderr: auto (live on a terminal), live or plain")
        ->capture_default_str()
        ->check(CLI::IsMember({"auto", "live", "plain"}));
  }

  int resolved_threads() const { return device.gpu() ? 1 : threads > 0 ? threads : linalg::threads(); }
  // The compute dtypes to time: the one --dtype names; with --dtype auto on the CPU each shape's faster of
  // float32 and bfloat16 where the CPU has bf16 instructions that oneDNN uses, else float32 (cpu_auto_tune_dtypes); a
  // GPU's default, bf16.
  std::vector<DType> dtypes() const {
    if (device.dtype == "auto" && !device.gpu()) return cpu_auto_tune_dtypes();
    return {device.iterates()};
  }
  // The file, or "" where it is unknown (no HOME): then tuning warns and keeps its entries in memory.
  std::string cache_path() const {
    if (!cache.empty()) return cache;
    try {
      return default_tune_cache_path();
    } catch (const Error&) {
      return "";
    }
  }

  std::vector<TuneEntry> tune(const std::vector<TuneRequest>& requests) const {
    const int n = resolved_threads();
    if (!device.gpu()) linalg::set_threads(n);
    auto bar = std::make_shared<CountProgress>(stderr, parse_progress_mode(progress));
    TuneSessionOptions o = session_options(cache_path(), n, bar);
    o.rounds = rounds;
    o.dtypes = dtypes();
    if (device.gpu()) o.backend = &device.backend();
    auto entries = tune_with_cache(requests, o);
    bar->finish();
    return entries;
  }
};

}  // namespace dmuon::cli
