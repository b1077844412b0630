// `dmuon train`: trains the GPT example (include/dmuon/trainer.hpp) on the CPU of every rank of mpirun, with a
// live progress line, a metrics CSV and optional checkpoints (a --save folder of step-N checkpoints).
// Only rank 0 prints and writes files (checkpoints are written by every rank: each saves the slices
// it holds).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli_kit/cli.hpp"
#include "cli_kit/field_flags.hpp"
#include "console/progress.hpp"
#include "muon_group_args.hpp"
#include "stop_signals.hpp"
#include "tune_session.hpp"
#include "dmuon/checkpoint.hpp"
#include "dmuon/checkpoint_rotation.hpp"
#include "dmuon/comm.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/metrics_csv.hpp"
#include "dmuon/optimizer_factory.hpp"
#include "dmuon/rank_agreement.hpp"
#include "dmuon/trainer.hpp"

namespace train {

struct TrainArgs {
  dmuon::TrainOptions train;
  std::string optim = "dmuon", shard_mode = "z3", progress = "auto", balancer = "milp";
  std::string csv, save;
  int threads = 0;
  bool tune = true;
  const CLI::Option* adamw_lr = nullptr;  // to tell whether --adamw-lr was given
  dmuon::cli::MuonGroupArgs muon_groups;
};

// Rank 0 runs `check`; every rank learns whether it passed, so none waits in a collective for a rank 0
// that has stopped. Rank 0 raises its own error, the others a pointer to it.
void check_on_rank0(dmuon::comm::Comm& comm, const std::function<void()>& check, const std::string& what) {
  const std::exception_ptr failure = dmuon::comm::capture_failure(
      [&] {
        if (comm.rank() == 0) check();
      },
      what);
  dmuon::comm::throw_if_any_failed(comm, failure, "rank 0 found a problem with " + what + " (its error says why)");
}

// One line: where a run stopped by a signal stopped, and how to go on from there.
void report_stop(const dmuon::Trainer& trainer, const std::string& save) {
  const char* signal = dmuon::cli::stop_signal_name(trainer.stop_requested());  // any rank's
  const long long step = trainer.steps_done(), steps = trainer.options().steps;
  if (save.empty())
    std::fprintf(stderr, "dmuon train: stopped by %s after step %lld of %lld; no checkpoint (no --save), so it cannot be resumed\n",
                 signal, step, steps);
  else
    std::fprintf(stderr, "dmuon train: stopped by %s after step %lld of %lld; checkpoint %s; to go on, rerun the same "
                 "command with --resume %s\n", signal, step, steps, trainer.last_checkpoint().c_str(), save.c_str());
}

void run_train(TrainArgs& args) {
  dmuon::TrainOptions& o = args.train;
  o.optim = dmuon::parse_optim_kind(args.optim);
  o.shard_mode = dmuon::shard::parse_mode(args.shard_mode);
  o.balancer = dmuon::parse_balancer(args.balancer);
  dmuon::MuonMatrixOptions defaults;
  defaults.ns = o.ns;
  o.muon_group = args.muon_groups.rules(defaults);
  const dmuon::ProgressMode mode = dmuon::parse_progress_mode(args.progress);
  std::shared_ptr<dmuon::comm::Comm> comm = dmuon::comm::world();
  const bool root = comm->rank() == 0;
  if (root && o.optim == dmuon::OptimKind::adamw && args.adamw_lr->count() > 0)
    std::fprintf(stderr,
                 "dmuon: warning: --adamw-lr sets the AdamW group of Muon runs; with --optim adamw every parameter "
                 "follows --lr, and --adamw-lr is ignored\n");
  // One BLAS thread per rank when several share the machine; alone, OpenBLAS's own setting.
  if (args.threads > 0)
    dmuon::linalg::set_threads(args.threads);
  else if (comm->size() > 1)
    dmuon::linalg::set_threads(1);

  // The checkpoint to resume from already at --steps: nothing to train, nothing to write.
  if (!o.resume.empty()) {
    const std::string checkpoint = dmuon::newest_checkpoint(o.resume);
    const int64_t step = dmuon::read_checkpoint_contents(checkpoint).steps();
    if (step >= o.steps) {
      if (root)
        std::printf("dmuon train: nothing to do: checkpoint %s is at step %lld, --steps %lld\n", checkpoint.c_str(),
                    static_cast<long long>(step), static_cast<long long>(o.steps));
      return;
    }
  }
  // Every output checked before tuning and step 1, so a run never ends in a write it could not do.
  const std::string csv_path = args.csv.empty() ? "runs/" + args.optim + ".csv" : args.csv;
  check_on_rank0(
      *comm,
      [&] {
        dmuon::MetricsCsvWriter::check(csv_path);
        if (!args.save.empty()) dmuon::check_checkpoint_folder(args.save);
      },
      "the output files");

  o.tune = args.tune;
  std::shared_ptr<dmuon::CountProgress> tune_bar;
  if (o.tune && o.optim != dmuon::OptimKind::adamw && root) {
    // Nothing is printed before the first progress call, so an error before tuning stays one line.
    tune_bar = std::make_shared<dmuon::CountProgress>(stderr, mode);
    dmuon::cli::TuneSessionArgs session;
    session.cache = o.tune_cache;
    const std::string cache = session.cache_path();
    const dmuon::TuneSessionOptions bar = dmuon::cli::session_options(cache, 0, tune_bar);
    o.tune_progress = [bar, cache, started = false](size_t done, size_t total, const std::string& what) mutable {
      if (!started)
        std::fprintf(stderr, "tuning Newton-Schulz for the model's shapes (cache %s)\n",
                     cache.empty() ? "none" : cache.c_str());
      started = true;
      bar.progress(done, total, what);
    };
    o.tune_warn = bar.warn;
  }
  o.save_dir = args.save;
  o.stop_signal = [] { return dmuon::cli::stop_signal_received(); };
  dmuon::Trainer trainer(o, comm);
  // Installed once the trainer stands: before it, a signal has no step to finish and nothing to save,
  // and the SIGTERM with which mpirun ends the other ranks after one rank's error must not announce a stop.
  dmuon::cli::install_stop_signals(comm->rank() == 0);
  if (tune_bar) {
    tune_bar->finish();
    std::fprintf(stderr, "tuned Newton-Schulz: %zu shape(s) ready in %.2f s\n", trainer.tuned().size(),
                 trainer.tune_seconds());
  }
  if (root && !trainer.resume_changes().empty()) {
    std::string changes;
    for (const std::string& c : trainer.resume_changes())  // "seed 2 (saved: 1)": the field, then its values
      changes += (changes.empty() ? "" : ", ") + dmuon::cli::train_flag(c.substr(0, c.find(' '))) + c.substr(c.find(' '));
    std::fprintf(stderr, "dmuon: warning: resuming with options other than the saved run's: %s; the run goes on under "
                 "the new options, so it will not match the uninterrupted one\n", changes.c_str());
  }
  std::optional<dmuon::MetricsCsvWriter> csv;
  std::optional<dmuon::ProgressDisplay> progress;
  // A resumed run appends to its metrics file (compare sees the whole history).
  check_on_rank0(
      *comm,
      [&] {
        const auto csv_dir = std::filesystem::path(csv_path).parent_path();
        std::error_code ec;
        if (!csv_dir.empty()) std::filesystem::create_directories(csv_dir, ec);
        DMUON_CHECK(!ec, "cannot create the folder of metrics file ", csv_path, ": ", ec.message());
        csv.emplace(csv_path, o.resume.empty() ? std::nullopt : std::optional<int64_t>(trainer.steps_done()));
      },
      "metrics file " + csv_path);
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
        static_cast<long long>(o.model.context), o.micro_batches, dmuon::peak_lr(o),
        o.optim == dmuon::OptimKind::adamw ? dmuon::peak_lr(o) : o.adamw_lr,
        static_cast<long long>(o.warmup), o.min_lr_ratio, static_cast<long long>(trainer.steps_done() + 1),
        static_cast<long long>(o.steps), static_cast<unsigned long long>(o.seed));
    std::fflush(stdout);
  }
  if (root) {
    // stdout: mpirun gives the ranks a terminal on stdout only, so the live line works under it.
    progress.emplace(o.steps, o.batch * o.model.context, stdout, mode);
  }
  std::vector<double> step_s;
  std::optional<double> last_val;
  std::string noted_checkpoint;
  while (!trainer.done() && !trainer.stop_requested()) {
    const dmuon::StepMetrics r = trainer.train_step();
    step_s.push_back(r.step_s);
    if (!root) continue;
    csv->write(r);
    progress->update(r.step, r.train_loss);
    if (trainer.last_checkpoint() != noted_checkpoint) {
      noted_checkpoint = trainer.last_checkpoint();
      progress->note("checkpoint " + noted_checkpoint + " complete");
    }
    if (r.val_loss) {
      last_val = r.val_loss;
      char line[160];
      std::snprintf(line, sizeof line, "step %lld: validation loss %.4f", static_cast<long long>(r.step), *r.val_loss);
      progress->note(line);
    }
  }
  if (trainer.stop_requested()) {
    if (root) {
      progress->finish();
      report_stop(trainer, args.save);
    }
    throw dmuon::cli::ExitStatus{dmuon::cli::kStoppedExitCode};
  }
  if (root) {
    progress->finish();
    std::printf("done: %zu steps, median step %.1f ms (max over ranks), final validation loss %s; metrics %s%s%s\n",
                step_s.size(), 1e3 * dmuon::median(step_s), last_val ? std::to_string(*last_val).c_str() : "n/a",
                csv_path.c_str(), args.save.empty() ? "" : "; checkpoint ", trainer.last_checkpoint().c_str());
  }
}

// "adamw | muon (1 rank) | muon-gather | dmuon": every kind of optimizer_factory.hpp's table.
std::string optim_help() {
  std::string out;
  for (const dmuon::OptimKindInfo& k : dmuon::optim_kinds())
    out += std::string(out.empty() ? "" : " | ") + k.name + (k.single_process ? " (1 rank)" : "");
  return out;
}

dmuon::cli::Registration reg("", [](CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  dmuon::TrainOptions& o = args->train;
  auto* c = app.add_subcommand("train", "Train the GPT example on text (run under mpirun for several ranks)");
  using dmuon::cli::at_least;
  using dmuon::cli::in_range;
  c->add_option("--optim", args->optim, optim_help())->capture_default_str();
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
  c->add_option("--batch", o.batch,
                "sequences per global batch B (divisible by ranks x micro-batches); make demo's batch")
      ->capture_default_str()
      ->check(at_least<int64_t>(1));
  c->add_option("--micro-batches", o.micro_batches, "gradient accumulation: micro-batches per step")
      ->capture_default_str()
      ->check(at_least(1));
  c->add_option("--lr", o.lr, "peak lr of Muon's matrices (muon*, dmuon) or of AdamW (adamw); 0: 0.02 / 3e-3")
      ->capture_default_str()
      ->check(at_least(0.0));
  args->adamw_lr = c->add_option("--adamw-lr", o.adamw_lr,
                                  "peak lr of the AdamW group (embeddings, head, norms, biases) in Muon runs")
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
  args->muon_groups.add_to(c);
  c->add_option("--data", o.data, "text file or folder (default: the fortunes corpus)");
  c->add_option("--shard-mode", args->shard_mode, "z3 | z2 | replicated (sharded optimizers)")->capture_default_str();
  c->add_option("--balancer", args->balancer, "dmuon: owner assignment rr | lpt | milp (CBC)")->capture_default_str();
  c->add_option("--save", args->save,
                "write checkpoints into this folder (DIR/step-N) after the last step, on SIGTERM/SIGINT and with "
                "--save-every; it may hold earlier step-N checkpoints, nothing else (default: none)");
  c->add_option("--save-every", o.save_every, "also checkpoint every this many steps, written in the background "
                "(0: only at the end)")
      ->capture_default_str()
      ->check(at_least<int64_t>(0));
  c->add_option("--keep", o.keep, "checkpoints kept in the --save folder (older ones are removed)")
      ->capture_default_str()
      ->check(at_least(1));
  c->add_option("--resume", o.resume,
                "start from this checkpoint, or from the newest complete one in this --save folder, and continue "
                "to --steps (default: none)");
  c->add_option("--csv", args->csv, "per-step metrics CSV (default runs/<optim>.csv)");
  c->add_option("--progress", args->progress,
                "auto | live (redrawn line) | plain (periodic lines), for training and tuning; auto is live on "
                "a terminal, and under mpirun stdout always is one: say plain when logging to a file")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "live", "plain"}));
  c->add_option("--threads", args->threads, "BLAS threads per rank (0: 1 with several ranks, else OpenBLAS's)")
      ->capture_default_str()
      ->check(dmuon::cli::thread_count());
  dmuon::cli::add_tune_flags(c, args->tune,
                             "Muon runs: tuned NS kernels and measured owner costs (rank 0 tunes shapes missing "
                             "from the cache at startup: about half a second for the demo model)");
  c->add_option("--tune-cache", o.tune_cache, dmuon::cli::kTuneCacheHelp);
  c->callback([args] { run_train(*args); });
});

}  // namespace train
