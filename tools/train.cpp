// `dmuon train`: trains the GPT example (include/dmuon/trainer.hpp) on every rank of mpirun, with a
// live progress line, a metrics CSV and an optional checkpoint. Only rank 0 prints and writes files
// (the checkpoint is written by every rank: each saves the slices it holds).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli.hpp"
#include "console/progress.hpp"
#include "tune_session.hpp"
#include "dmuon/comm.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/metrics_csv.hpp"
#include "dmuon/rank_agreement.hpp"
#include "dmuon/trainer.hpp"

namespace {

struct TrainArgs {
  dmuon::TrainOptions train;
  std::string optim = "dmuon", shard_mode = "z3", progress = "auto", balancer = "milp";
  std::string csv, save;
  int threads = 0;
  bool tune = true;
};

void run_train(TrainArgs& args) {
  dmuon::TrainOptions& o = args.train;
  o.optim = dmuon::parse_optim_kind(args.optim);
  o.shard_mode = dmuon::parse_shard_mode(args.shard_mode);
  o.balancer = dmuon::parse_balancer(args.balancer);
  DMUON_CHECK(args.progress == "auto" || args.progress == "live" || args.progress == "plain",
              "--progress must be auto, live or plain, got '", args.progress, "'");
  std::shared_ptr<dmuon::comm::Comm> comm = dmuon::comm::world();
  // One BLAS thread per rank when several share the machine; alone, OpenBLAS's own setting.
  if (args.threads > 0)
    dmuon::linalg::set_threads(args.threads);
  else if (comm->size() > 1)
    dmuon::linalg::set_threads(1);

  o.tune = args.tune;
  if (o.tune && o.optim != dmuon::OptimKind::adamw && comm->rank() == 0) {
    // Nothing is printed before the first progress call, so an error before tuning stays one line.
    const dmuon::TuneSessionOptions bar =
        dmuon::cli::session_options(o.tune_cache.empty() ? dmuon::default_tune_cache_path() : o.tune_cache, 0);
    o.tune_progress = [bar, started = false](size_t done, size_t total, const std::string& what) mutable {
      if (!started)
        std::fprintf(stderr, "tuning Newton-Schulz for the model's shapes (cache %s)\n", bar.cache_path.c_str());
      started = true;
      bar.progress(done, total, what);
    };
    o.tune_warn = bar.warn;
  }
  dmuon::Trainer trainer(o, comm);
  const bool root = trainer.rank() == 0;
  if (root && o.tune && o.optim != dmuon::OptimKind::adamw)
    std::fprintf(stderr, "\ntuned Newton-Schulz: %zu shape(s) ready in %.2f s\n", trainer.tuned().size(),
                 trainer.tune_seconds());
  const std::string csv_path = args.csv.empty() ? "runs/" + args.optim + ".csv" : args.csv;
  std::optional<dmuon::MetricsCsvWriter> csv;
  std::optional<dmuon::ProgressDisplay> progress;
  // Rank 0 creates the metrics file; every rank learns whether it could, so none waits in a
  // collective for a rank 0 that has stopped.
  const std::exception_ptr csv_failure = dmuon::comm::capture_failure(
      [&] {
        if (!root) return;
        const auto csv_dir = std::filesystem::path(csv_path).parent_path();
        if (!csv_dir.empty()) std::filesystem::create_directories(csv_dir);
        csv.emplace(csv_path);
      },
      "cannot create the folder of metrics file " + csv_path);
  dmuon::comm::throw_if_any_failed(*comm, csv_failure,
                                   "rank 0 cannot write the metrics file " + csv_path + " (its error says why)");
  if (root) {
    int64_t params = 0;
    for (const auto& s : dmuon::gpt_param_specs(o.model)) params += s.numel();
    std::printf(
        "dmuon train: %s on %d rank(s), %d BLAS thread(s) each; GPT L=%lld C=%lld heads=%lld T=%lld, %lld "
        "parameters; batch %lld x %lld tokens, %d micro-batch(es); lr %g (adamw group %g), warmup %lld, "
        "cosine to %g x; steps %lld..%lld; seed %llu\n",
        args.optim.c_str(), trainer.world_size(), dmuon::linalg::threads(), static_cast<long long>(o.model.layers),
        static_cast<long long>(o.model.width), static_cast<long long>(o.model.heads),
        static_cast<long long>(o.model.context), static_cast<long long>(params), static_cast<long long>(o.batch),
        static_cast<long long>(o.model.context), o.micro_batches, o.lr > 0 ? o.lr : dmuon::default_lr(o.optim),
        o.optim == dmuon::OptimKind::adamw ? o.lr > 0 ? o.lr : dmuon::default_lr(o.optim) : o.adamw_lr,
        static_cast<long long>(o.warmup), o.min_lr_ratio, static_cast<long long>(trainer.steps_done() + 1),
        static_cast<long long>(o.steps), static_cast<unsigned long long>(o.seed));
    std::fflush(stdout);
  }
  if (root) {
    const auto mode = args.progress == "live"    ? dmuon::ProgressDisplay::Mode::live
                      : args.progress == "plain" ? dmuon::ProgressDisplay::Mode::plain
                                                 : dmuon::ProgressDisplay::Mode::automatic;
    // stdout: mpirun gives the ranks a terminal on stdout only, so the live line works under it.
    progress.emplace(o.steps, o.batch * o.model.context, stdout, mode);
  }
  std::vector<double> step_s;
  std::optional<double> last_val;
  while (!trainer.done()) {
    const dmuon::StepMetrics r = trainer.train_step();
    step_s.push_back(r.step_s);
    if (!root) continue;
    csv->write(r);
    progress->update(r.step, r.train_loss);
    if (r.val_loss) {
      last_val = r.val_loss;
      char line[160];
      std::snprintf(line, sizeof line, "step %lld: validation loss %.4f", static_cast<long long>(r.step), *r.val_loss);
      progress->note(line);
    }
  }
  if (!args.save.empty()) trainer.save(args.save);
  if (root) {
    progress->finish();
    std::printf("done: %zu steps, median step %.1f ms (max over ranks), final validation loss %s; metrics %s%s%s\n",
                step_s.size(), 1e3 * dmuon::median(step_s), last_val ? std::to_string(*last_val).c_str() : "n/a",
                csv_path.c_str(), args.save.empty() ? "" : "; checkpoint ", args.save.c_str());
  }
}

dmuon::cli::Registration reg("", [](CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  dmuon::TrainOptions& o = args->train;
  auto* c = app.add_subcommand("train", "Train the GPT example on text (run under mpirun for several ranks)");
  using dmuon::cli::at_least;
  using dmuon::cli::in_range;
  c->add_option("--optim", args->optim, "adamw | muon (1 rank) | muon-gather | dmuon")->capture_default_str();
  c->add_option("--steps", o.steps, "optimizer steps in total")->capture_default_str()->check(at_least<int64_t>(1));
  c->add_option("--seed", o.seed, "initialisation and batch order")
      ->capture_default_str()
      ->check(at_least<uint64_t>(0));
  c->add_option("--layers", o.model.layers, "transformer blocks L")->capture_default_str()->check(at_least<int64_t>(1));
  c->add_option("--width", o.model.width, "channels C")->capture_default_str()->check(at_least<int64_t>(1));
  c->add_option("--heads", o.model.heads, "attention heads (divide the width)")
      ->capture_default_str()
      ->check(at_least<int64_t>(1));
  c->add_option("--context", o.model.context, "sequence length T")->capture_default_str()->check(at_least<int64_t>(1));
  c->add_option("--batch", o.batch, "sequences per global batch B (divisible by ranks x micro-batches)")
      ->capture_default_str()
      ->check(at_least<int64_t>(1));
  c->add_option("--micro-batches", o.micro_batches, "gradient accumulation: micro-batches per step")
      ->capture_default_str()
      ->check(at_least(1));
  c->add_option("--lr", o.lr, "peak lr of Muon's matrices (muon*, dmuon) or of AdamW (adamw); 0: 0.02 / 3e-3")
      ->capture_default_str()
      ->check(at_least(0.0));
  c->add_option("--adamw-lr", o.adamw_lr, "peak lr of the AdamW group (embeddings, head, norms, biases) in Muon runs")
      ->capture_default_str()
      ->check(dmuon::cli::positive());
  c->add_option("--weight-decay", o.weight_decay, "decoupled weight decay")
      ->capture_default_str()
      ->check(at_least(0.0));
  c->add_option("--warmup", o.warmup, "linear warmup steps (then cosine decay)")
      ->capture_default_str()
      ->check(at_least<int64_t>(0));
  c->add_option("--min-lr-ratio", o.min_lr_ratio, "the cosine ends at this fraction of the peak lr")
      ->capture_default_str()
      ->check(in_range(0.0, 1.0));
  c->add_option("--val-every", o.val_every, "validate every this many steps (and at the end); 0: only at the end")
      ->capture_default_str()
      ->check(at_least<int64_t>(0));
  c->add_option("--val-batches", o.val_batches, "global batches of validation text per evaluation")
      ->capture_default_str()
      ->check(at_least<int64_t>(1));
  c->add_option("--data", o.data, "text file or folder (default: the fortunes corpus)");
  c->add_option("--shard-mode", args->shard_mode, "z3 | z2 | replicated (sharded optimizers)")->capture_default_str();
  c->add_option("--balancer", args->balancer, "dmuon: owner assignment rr | lpt | milp (CBC)")->capture_default_str();
  c->add_option("--save", args->save, "write a checkpoint to this folder at the end");
  c->add_option("--resume", o.resume, "start from this checkpoint folder (continues to --steps)");
  c->add_option("--csv", args->csv, "per-step metrics CSV (default runs/<optim>.csv)");
  c->add_option("--progress", args->progress,
                "auto | live (redrawn line) | plain (periodic lines); auto is live on a terminal, and "
                "under mpirun stdout always is one: say plain when logging to a file")
      ->capture_default_str();
  c->add_option("--threads", args->threads, "BLAS threads per rank (0: 1 with several ranks, else OpenBLAS's)")
      ->capture_default_str()
      ->check(dmuon::cli::thread_count());
  c->add_flag("--tune,!--no-tune", args->tune,
              "Muon runs: tuned NS kernels and measured owner costs, on by default (rank 0 tunes shapes missing "
              "from the cache at startup: about half a second for the demo model)");
  c->add_option("--tune-cache", o.tune_cache,
                "tuning cache file (default $XDG_CACHE_HOME/dmuon/tune.json or ~/.cache/dmuon/tune.json)");
  c->callback([args] { run_train(*args); });
});

}  // namespace
