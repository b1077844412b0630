// `dmuon tune`: autotune Newton–Schulz for a model's matrix shapes (DESIGN 3.5) and cache the
// winners; a second run finds everything in the cache and tunes nothing.
#include <cstdio>

#include <nlohmann/json.hpp>

#include "cli_kit/cli.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/tune.hpp"
#include "cli_kit/model_args.hpp"
#include "tune_session.hpp"

namespace dmuon::cli {

namespace tune_command {

struct TuneArgs {
  ModelArgs model;
  TuneSessionArgs session;
  int ranks = 1;
  bool json = false;
};

// "12x34 b2" for the line that says which dtype each shape runs in.
std::string shape_batch(const TuneEntry& e) {
  return std::to_string(e.rows) + "x" + std::to_string(e.cols) + " b" + std::to_string(e.batch);
}

// With several dtypes timed: "compute dtype chosen by measurement among bfloat16, float32: bfloat16 for 896x4864 b1
// (float32 2.31x slower), ...; float32 for ..." (each shape's other dtype: its best time over the winner's).
std::string dtype_choice_line(const std::vector<DType>& dtypes, const std::vector<TuneEntry>& entries) {
  std::string line = "compute dtype chosen by measurement among";
  for (size_t i = 0; i < dtypes.size(); ++i) line += (i ? ", " : " ") + to_string(dtypes[i]);
  std::string sep = ":";
  for (const DType d : dtypes) {
    std::string shapes;
    for (const auto& e : entries) {
      if (e.options.dtype != d) continue;
      char ratio[64] = "";
      for (const auto& [other, s] : e.dtype_seconds)
        if (other != d) std::snprintf(ratio, sizeof ratio, " (%s %.2fx slower)", to_string(other).c_str(), s / e.seconds);
      shapes += (shapes.empty() ? "" : ", ") + shape_batch(e) + ratio;
    }
    if (!shapes.empty()) line += sep + " " + to_string(d) + " for " + shapes, sep = ";";
  }
  return line;
}

void run(const TuneArgs& a) {
  const auto params = a.model.load();
  const auto requests = tune_requests(params, a.ranks);
  const auto entries = a.session.tune(requests);
  const std::vector<DType> dtypes = a.session.dtypes();
  if (a.json) {
    nlohmann::json out = {{"model", a.model.label()},   {"ranks", a.ranks},
                          {"threads", a.session.resolved_threads()}, {"cache", a.session.cache_path()},
                          {"dtypes", tune_dtype_key(dtypes)}, {"entries", nlohmann::json::array()}};
    for (const auto& e : entries) {
      nlohmann::json dtype_seconds = nlohmann::json::object();
      for (const auto& [d, s] : e.dtype_seconds) dtype_seconds[to_string(d)] = s;
      out["entries"].push_back({{"rows", e.rows}, {"cols", e.cols}, {"batch", e.batch}, {"choice", describe(e.options)},
                                {"dtype", to_string(e.options.dtype)}, {"seconds", e.seconds},
                                {"default_seconds", e.default_seconds}, {"speedup", e.default_seconds / e.seconds},
                                {"dtype_seconds", dtype_seconds}});
    }
    std::printf("%s\n", out.dump(2).c_str());
    return;
  }
  const std::string cache = a.session.cache_path();
  std::printf("%s: %zu shapes, batches for D = %d, %d BLAS threads; cache %s\n\n", a.model.label().c_str(),
              requests.size(), a.ranks, a.session.resolved_threads(), cache.empty() ? "none" : cache.c_str());
  std::printf("%-12s %5s  %-36s %-9s %10s %12s %8s\n", "shape", "batch", "chosen", "dtype", "time_ms", "untuned_ms",
              "speedup");
  for (const auto& e : entries) {
    const std::string shape = std::to_string(e.rows) + "x" + std::to_string(e.cols);
    std::printf("%-12s %5d  %-36s %-9s %10.2f %12.2f %7.2fx\n", shape.c_str(), e.batch, describe(e.options).c_str(),
                to_string(e.options.dtype).c_str(), 1e3 * e.seconds, 1e3 * e.default_seconds,
                e.default_seconds / e.seconds);
  }
  const NsOptions untuned = untuned_options(a.session.resolved_threads(), dtypes[0]);
  std::printf("\nuntuned: %s %s\n", describe(untuned).c_str(), to_string(untuned.dtype).c_str());
  if (dtypes.size() > 1) std::printf("%s\n", dtype_choice_line(dtypes, entries).c_str());
}

Registration reg("", [](CLI::App& app) {
  auto args = std::make_shared<TuneArgs>();
  auto* c = app.add_subcommand("tune", "Autotune Newton-Schulz for a model's matrix shapes and cache the winners");
  args->model.add_to(c);
  c->add_option("--ranks", args->ranks, "Tune the per-rank batch sizes of D ranks (ceil(count/D))")
      ->capture_default_str()
      ->check(at_least(1));
  args->session.add_to(c);
  args->session.device.add_to(c, "each shape's faster of bf16 and f32, timed, with AVX-512 BF16 or AMX; else f32");
  c->add_flag("--json", args->json, "Print JSON instead of a table");
  c->callback([args] { run(*args); });
});

}  // namespace tune_command

}  // namespace dmuon::cli
