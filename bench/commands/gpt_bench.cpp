// `dmuon bench gpt`: forward and backward time of the GPT example on real text batches, to size training
// runs (e.g. the demo). Reports the median over repeats of one forward, one backward and their sum, the
// tokens per second and the achieved GFLOP/s (gpt_forward_flops, backward counted as twice forward).
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_kit/cli.hpp"
#include "dmuon/data.hpp"
#include "dmuon/error.hpp"
#include "dmuon/gpt.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/statistics.hpp"

namespace gpt_bench {

using Clock = std::chrono::steady_clock;

struct BenchArgs {
  dmuon::GptConfig config;
  int64_t batch = 16;
  int threads = 0, repeats = 10;
  std::string data;
  bool json = false;
};

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

void run_bench(const BenchArgs& args) {
  DMUON_CHECK(args.repeats >= 1, "--repeats must be at least 1, got ", args.repeats);
  if (args.threads > 0) dmuon::linalg::set_threads(args.threads);
  const dmuon::GptConfig& c = args.config;
  const int64_t T = c.context, B = args.batch;
  dmuon::Gpt model(c);
  dmuon::GptBuffers buf(model);
  buf.init(c, model.params(), 1);
  buf.bind_to(model);
  const dmuon::TextCorpus corpus = dmuon::load_text_corpus(args.data);
  std::vector<double> fwd, bwd;
  float loss = 0;
  for (int r = 0; r < args.repeats + 1; r++) {  // the first run warms caches and allocates activations
    const dmuon::TokenBatch batch = dmuon::sample_batch(corpus.train, B, T, 1, r);
    buf.zero_grads();
    auto t0 = Clock::now();
    loss = model.forward(batch.inputs.data(), batch.targets.data(), B, T);
    const double f = seconds_since(t0);
    t0 = Clock::now();
    model.backward();
    const double b = seconds_since(t0);
    if (r > 0) {
      fwd.push_back(f);
      bwd.push_back(b);
    }
  }
  int64_t params = 0;
  for (const auto& s : model.params()) params += s.numel();
  const double f = dmuon::median(fwd), b = dmuon::median(bwd);
  const double flops = 3.0 * dmuon::gpt_forward_flops(c, T) * static_cast<double>(B);
  nlohmann::json out = {{"blas", dmuon::linalg::blas_description()},
                        {"cpu", dmuon::linalg::cpu_model()},
                        {"threads", dmuon::linalg::threads()},
                        {"layers", c.layers},
                        {"width", c.width},
                        {"heads", c.heads},
                        {"context", c.context},
                        {"batch", B},
                        {"parameters", params},
                        {"repeats", args.repeats},
                        {"forward_s", f},
                        {"backward_s", b},
                        {"forward_backward_s", f + b},
                        {"tokens_per_s", static_cast<double>(B * T) / (f + b)},
                        {"gflops", flops / (f + b) / 1e9},
                        {"last_loss", loss}};
  if (args.json) {
    std::printf("%s\n", out.dump(1).c_str());
    return;
  }
  std::printf("GPT example, float32; %s; %s; %d BLAS threads\n", out["blas"].get<std::string>().c_str(),
              out["cpu"].get<std::string>().c_str(), dmuon::linalg::threads());
  std::printf("L=%lld C=%lld heads=%lld T=%lld B=%lld, %lld parameters; median of %d (after one warm-up)\n\n",
              static_cast<long long>(c.layers), static_cast<long long>(c.width), static_cast<long long>(c.heads),
              static_cast<long long>(T), static_cast<long long>(B), static_cast<long long>(params), args.repeats);
  std::printf("%12s %12s %14s %12s %10s\n", "forward ms", "backward ms", "fwd+bwd ms", "tokens/s", "GFLOP/s");
  std::printf("%12.2f %12.2f %14.2f %12.0f %10.1f\n", 1e3 * f, 1e3 * b, 1e3 * (f + b),
              out["tokens_per_s"].get<double>(), out["gflops"].get<double>());
}

dmuon::cli::Registration reg("", [](CLI::App& bench) {
  auto args = std::make_shared<BenchArgs>();
  auto* c = bench.add_subcommand("gpt", "GPT example: forward and backward time on text batches");
  const auto positive = dmuon::cli::at_least<int64_t>(1);
  c->add_option("--layers", args->config.layers, "transformer blocks")->capture_default_str()->check(positive);
  c->add_option("--width", args->config.width, "channels C")->capture_default_str()->check(positive);
  c->add_option("--heads", args->config.heads, "attention heads (divide the width)")
      ->capture_default_str()
      ->check(positive);
  c->add_option("--context", args->config.context, "sequence length T")->capture_default_str()->check(positive);
  c->add_option("--batch", args->batch, "sequences per batch B")->capture_default_str()->check(positive);
  c->add_option("--data", args->data, "text file or folder (default: the fortunes corpus)");
  c->add_option("--threads", args->threads, "BLAS threads (0: OpenBLAS's setting)")
      ->capture_default_str()
      ->check(dmuon::cli::thread_count());
  c->add_option("--repeats", args->repeats, "timed forward+backward runs (median reported)")
      ->capture_default_str()
      ->check(dmuon::cli::at_least(1));
  c->add_flag("--json", args->json, "print one JSON object instead of the table");
  c->callback([args] { run_bench(*args); });
});

}  // namespace gpt_bench
