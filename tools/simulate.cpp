// dmuon simulate: one training step of a real model on a simulated cluster (8…256 devices by default), for
// each optimizer (adamw, muon-gather-plain, muon-gather, dmuon). See include/dmuon/sim.hpp and
// docs/simulator.md. `--gpt demo|large` models the GPT example `dmuon bench e2e` trains (its parameter
// shapes, its forward flop count, its global batch split over the devices), to set beside that benchmark.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unistd.h>

#include "cli_kit/cli.hpp"
#include "dmuon/gpt.hpp"
#include "dmuon/models.hpp"
#include "cli_kit/e2e_configs.hpp"
#include "cli_kit/model_args.hpp"
#include "console/plot.hpp"
#include "console/progress.hpp"
#include "dmuon/sim.hpp"
#include "mesh_args.hpp"
#include "muon_group_args.hpp"

namespace dmuon::cli {

namespace simulate {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

struct SimulateArgs {
  ModelArgs model;
  std::vector<int> devices = {8, 16, 32, 64, 128, 256};
  int per_node = 8;
  std::string profile = "a800";
  double tokens = 4096;
  std::string balancer = "milp";
  MeshArgs mesh;
  MuonGroupArgs muon_groups;  // their splits: a split matrix's Newton–Schulz runs its blocks
  double memory_balance = 0;  // PlanOptions::memory_balance of DMuon's plan
  bool zero2 = false;
  bool json = false;
  std::string plot;
  std::string progress = "auto";
  std::string gpt;  // "demo" or "large": the GPT example instead of --model
  int64_t batch = 0;  // with --gpt: sequences per step over all devices; 0: the configuration's (bench e2e's)
};

// What is simulated: parameters, and per device count the tokens and forward flops of each device.
struct Workload {
  std::string label;
  std::vector<ParamSpec> params;
  GptConfig gpt;
  int64_t batch = 0;  // GPT: sequences per step over all devices
  bool is_gpt = false;
  double tokens_per_device(const SimulateArgs& a, int devices) const {
    return is_gpt ? static_cast<double>(batch) * static_cast<double>(gpt.context) / devices : a.tokens;
  }
  // The GPT's own count (gpt_forward_flops, as `dmuon bench gpt` reports it) split over its units: the
  // embeddings do no matmul, every block the same, the head the rest. Empty for manifests (6·P·tokens rule).
  std::vector<double> unit_forward_flops(int devices) const {
    if (!is_gpt) return {};
    GptConfig one = gpt, two = gpt;
    one.layers = 1;
    two.layers = 2;
    const double block = gpt_forward_flops(two, gpt.context) - gpt_forward_flops(one, gpt.context);
    const double head = gpt_forward_flops(one, gpt.context) - block;
    const double sequences = static_cast<double>(batch) / devices;
    std::vector<double> out(gpt.layers + 2, sequences * block);
    out.front() = 0;
    out.back() = sequences * head;
    return out;
  }
};

Workload workload(const SimulateArgs& a) {
  Workload w;
  if (a.gpt.empty()) {
    w.label = a.model.label();
    w.params = a.model.load();
    return w;
  }
  DMUON_CHECK(a.model.model.empty() && a.model.hf_config.empty() && a.model.layers == 0,
              "--gpt models the GPT example: give it without --model, --hf-config or --layers");
  w.is_gpt = true;
  const E2eConfig config = e2e_config(a.gpt);
  w.gpt = config.model;
  w.batch = a.batch > 0 ? a.batch : config.batch;
  w.params = gpt_param_specs(w.gpt);
  w.label = "GPT " + a.gpt + " (L" + std::to_string(w.gpt.layers) + " C" + std::to_string(w.gpt.width) + " NH" +
            std::to_string(w.gpt.heads) + " T" + std::to_string(w.gpt.context) + ", " + std::to_string(w.batch) +
            " sequences per step over all devices)";
  return w;
}

void print_assumptions(const HardwareProfile& hw, const SimulateArgs& a, const Workload& w) {
  std::printf("Hardware profile %s: %s\n", hw.name.c_str(), hw.description.c_str());
  std::printf("  peak %.3g TFLOP/s at MFU %.0f%%; NS at %.3g TFLOP/s x %.0f%%; HBM %.0f GB/s; %d SMs\n",
              hw.peak_flops / 1e12, 100 * hw.mfu, hw.ns_flops / 1e12, 100 * hw.ns_efficiency,
              hw.hbm_bytes_per_s / 1e9, hw.sm_count);
  std::printf("  NVLink %.3g GB/s per device, network %.3g GB/s per node, latency %.2g/%.2g us, launch %.2g us\n",
              hw.intra_node_bytes_per_s / 1e9, hw.inter_node_bytes_per_s / 1e9, hw.intra_node_latency_s * 1e6,
              hw.inter_node_latency_s * 1e6, hw.kernel_launch_s * 1e6);
  std::printf("  symmetric products: SYRK %.2fx, upper-triangle GEMM %.2fx faster than the full GEMM; NS in %.0f-byte "
              "elements; %s\n",
              hw.syrk_speedup, hw.sym_gemm_speedup, hw.ns_bytes_per_element,
              hw.batched_kernels ? "one kernel per operation per same-shape batch" : "one kernel per matrix");
  if (hw.shared_cores > 0)
    std::printf("  measured with %d ranks sharing %d cores: a run with D ranks scales BLAS rates by %d/D and\n"
                "  single-threaded rates by min(1, %d/D)/%.2g (rates per device count: --json 'device')\n",
                hw.calibration_ranks, hw.shared_cores, hw.calibration_ranks, hw.shared_cores,
                std::min(1.0, static_cast<double>(hw.shared_cores) / hw.calibration_ranks));
  for (const auto& [field, source] : hw.sources) std::printf("  - %s: %s\n", field.c_str(), source.c_str());
  if (w.is_gpt) {
    std::printf("Model: %s, %d devices per node, %s, owners by %s\n", w.label.c_str(), a.per_node,
                a.zero2 ? "Z2" : "Z3", a.balancer.c_str());
  } else {
    std::printf("Model: %s, %.0f tokens per device, %d devices per node, %s, owners by %s\n", w.label.c_str(),
                a.tokens, a.per_node, a.zero2 ? "Z2" : "Z3", a.balancer.c_str());
  }
  std::printf("Model of the step (docs/simulator.md): forward+backward = 3x %s at peak*MFU; per unit a ring\n"
              "all-gatherv of its weights paced by the largest block and a two-stage reduce-scatterv of its gradients\n"
              "(FSDP's even blocks; DMuon's owner-aligned, uneven ones); one compute and one comm stream with\n"
              "one-unit prefetch; NS: every kernel of the algorithm on an HBM/SM-occupancy roofline plus a launch;\n"
              "momentum, weight and AdamW updates and the gradient norm at memory bandwidth; the norm's all-reduce.\n\n",
              w.is_gpt ? "the GPT's forward flops (gpt_forward_flops, attention included)"
                       : "2*params*tokens (attention T^2 ignored)");
}

void write_plot(const std::vector<sim::SimResult>& results, const std::string& path, const std::string& title) {
  std::ostringstream data;
  for (const auto& r : results) {
    const auto& s = r.steps;
    data << r.devices << " " << s.at(sim::ComparedOptimizer::muon_gather_plain).optimizer_s / s.at(sim::ComparedOptimizer::dmuon).optimizer_s
         << " " << s.at(sim::ComparedOptimizer::adamw).step_s * 1e3 << " " << s.at(sim::ComparedOptimizer::muon_gather_plain).step_s * 1e3
         << " " << s.at(sim::ComparedOptimizer::dmuon).step_s * 1e3 << "\n";
  }
  std::ostringstream script;
  script << "set multiplot layout 1,2 title " << gnuplot_quoted(title) << "\nset logscale x 2\nset key top left\n"
         << "set xlabel 'devices'\nset ylabel 'optimizer-step speedup (x)'\n"
         << "plot '-' using 1:2 with linespoints lw 2 title 'DMuon vs muon-gather-plain'\n"
         << data.str() << "e\nset ylabel 'training step (ms)'\n"
         << "plot '-' using 1:3 with linespoints lw 2 title 'AdamW', '-' using 1:4 with linespoints lw 2 title "
            "'muon-gather-plain', '-' using 1:5 with linespoints lw 2 title 'DMuon'\n"
         << data.str() << "e\n" << data.str() << "e\n" << data.str() << "e\nunset multiplot\n";
  PlotOptions options;
  options.width = 1100;
  options.height = 480;
  render_plot(script.str(), path, options);
}

double held_of_fullest(const std::vector<sim::RankMemory>& ranks) { return ranks[sim::fullest_rank(ranks)].held(); }

// The fullest rank's bytes held between steps of each optimizer (sim::rank_memory), and how far DMuon's plan leaves its
// fullest rank above the mean of its ranks.
void print_memory(const std::vector<sim::SimResult>& results) {
  std::printf("\nmemory per rank, held between steps (GiB, the fullest rank: weights+gradients / state / step buffers / "
              "NS workspace = total):\n");
  for (const auto& r : results) {
    std::printf("%7d |", r.devices);
    for (const auto& [o, memory] : r.memory) {
      const sim::RankMemory& m = memory[sim::fullest_rank(memory)];
      std::printf(" %s %.3g/%.3g/%.3g/%.3g = %.3g", sim::to_string(o).c_str(), (m.weights + m.gradients) / kGiB,
                  m.state / kGiB, m.step_buffers / kGiB, m.ns_workspace / kGiB, m.held() / kGiB);
    }
    const auto& dm = r.memory.at(sim::ComparedOptimizer::dmuon);
    double mean = 0;
    for (const auto& m : dm) mean += m.held() / static_cast<double>(dm.size());
    const double fullest = held_of_fullest(dm);
    std::printf(" | dmuon vs adamw %.3fx, fullest/mean %.3f\n",
                fullest / held_of_fullest(r.memory.at(sim::ComparedOptimizer::adamw)), fullest / mean);
  }
}

void run(SimulateArgs a) {
  sim::SimOptions options;
  options.mesh = a.mesh.mesh(0, "");
  if (options.mesh) a.devices = {options.mesh->ranks()};
  const Workload w = workload(a);
  const HardwareProfile hw = load_hardware_profile(a.profile);
  options.zero3 = !a.zero2;
  options.plan.balancer = parse_balancer(a.balancer);
  options.plan.memory_balance = a.memory_balance;
  if (!a.muon_groups.texts.empty()) options.ns_blocks = a.muon_groups.ns_blocks(w.params);
  if (w.is_gpt) {
    for (int d : a.devices)
      DMUON_CHECK(w.batch % d == 0, "--batch ", w.batch, " sequences do not split evenly over ", d, " devices");
  }

  std::vector<sim::SimResult> results;
  {
    // JSON is often read from stdout and stderr together: in a log, auto stays quiet with --json.
    const bool quiet = a.json && a.progress == "auto" && !isatty(fileno(stderr));
    CountProgress progress(quiet ? nullptr : stderr, parse_progress_mode(a.progress));
    for (size_t i = 0; i < a.devices.size(); ++i) {
      const int d = a.devices[i];
      progress.update(i, a.devices.size(), "simulating " + std::to_string(d) + " devices");
      options.tokens_per_device = w.tokens_per_device(a, d);
      options.unit_forward_flops = w.unit_forward_flops(d);
      results.push_back(sim::simulate_step(w.params, hw, {d, a.per_node}, options));
      progress.update(i + 1, a.devices.size(), std::to_string(d) + " devices simulated");
    }
  }

  if (a.json) {
    nlohmann::json out = {{"model", w.label}, {"profile", hw.name}, {"devices_per_node", a.per_node},
                          {"sources", hw.sources}, {"results", nlohmann::json::array()},
                          {"syrk_speedup", hw.syrk_speedup}, {"sym_gemm_speedup", hw.sym_gemm_speedup},
                          {"kernel_launch_s", hw.kernel_launch_s}, {"batched_kernels", hw.batched_kernels}};
    if (w.is_gpt) {
      out["gpt"] = {{"config", a.gpt},        {"layers", w.gpt.layers},   {"width", w.gpt.width},
                    {"heads", w.gpt.heads},   {"context", w.gpt.context}, {"batch_sequences", w.batch}};
    } else {
      out["tokens_per_device"] = a.tokens;
    }
    for (size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      const auto& dev = r.device;
      nlohmann::json row = {{"devices", r.devices}, {"plan_gap_pct", r.plan.gap_pct},
                            {"plan_balancer", to_string(r.plan.balancer)}, {"plan_fell_back", r.plan.fell_back},
                            {"tokens_per_device", w.tokens_per_device(a, r.devices)},
                            {"device", {{"peak_flops", dev.peak_flops},
                                        {"ns_flops", dev.ns_flops},
                                        {"hbm_bytes_per_s", dev.hbm_bytes_per_s},
                                        {"intra_node_bytes_per_s", dev.intra_node_bytes_per_s},
                                        {"intra_node_latency_s", dev.intra_node_latency_s},
                                        {"kernel_launch_s", dev.kernel_launch_s}}}};
      for (const auto& [o, s] : r.steps) {
        const std::vector<sim::RankMemory>& memory = r.memory.at(o);
        const sim::RankMemory& full = memory[sim::fullest_rank(memory)];
        double held = 0;
        for (const auto& m : memory) held += m.held();
        row[sim::to_string(o)] = {{"step_s", s.step_s},
                                  {"memory", {{"fullest_rank", sim::fullest_rank(memory)},
                                              {"weights", full.weights},
                                              {"gradients", full.gradients},
                                              {"state", full.state},
                                              {"step_buffers", full.step_buffers},
                                              {"ns_workspace", full.ns_workspace},
                                              {"held", full.held()},
                                              {"mean_held", held / static_cast<double>(memory.size())}}},
                                  {"compute_s", s.compute_s},
                                  {"exposed_comm_s", s.exposed_comm_s},
                                  {"optimizer_s", s.optimizer_s},
                                  {"optimizer_comm_s", s.optimizer_comm_s},
                                  {"optimizer_ns_s", s.optimizer_ns_s},
                                  {"optimizer_elementwise_s", s.optimizer_elementwise_s},
                                  {"optimizer_launch_s", s.optimizer_launch_s},
                                  {"fwd_bwd_s", s.step_s - s.optimizer_s},
                                  {"bytes_per_device", s.bytes_per_device}};
      }
      if (options.mesh) {
        row["mesh"] = mesh_json(*options.mesh);
        row["plan_per_rank"] = nlohmann::json::array();
        for (const auto& rp : r.plan.per_rank)
          row["plan_per_rank"].push_back({{"ns_s", rp.time_s},
                                          {"step_sent_bytes", rp.step_sent_bytes},
                                          {"step_received_bytes", rp.step_received_bytes}});
      }
      out["results"].push_back(row);
    }
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    print_assumptions(hw, a, w);
    std::printf("%7s | %-33s | %-17s | %-32s | %s\n", "", "optimizer step (ms)", "DMuon opt speedup",
                "training step (ms)", "DMuon e2e");
    std::printf("%7s | %10s %10s %10s | %8s %8s | %10s %10s %10s | %9s %9s\n", "devices", "gath-plain", "gather",
                "dmuon", "vs plain", "vs gath", "adamw", "gath-plain", "dmuon", "vs adamw", "vs plain");
    for (const auto& r : results) {
      const auto& s = r.steps;
      const auto& plain = s.at(sim::ComparedOptimizer::muon_gather_plain);
      const auto& gather = s.at(sim::ComparedOptimizer::muon_gather);
      const auto& dm = s.at(sim::ComparedOptimizer::dmuon);
      const auto& adamw = s.at(sim::ComparedOptimizer::adamw);
      std::printf("%7d | %10.2f %10.2f %10.2f | %7.2fx %7.2fx | %10.2f %10.2f %10.2f | %+8.1f%% %8.2fx\n", r.devices,
                  plain.optimizer_s * 1e3, gather.optimizer_s * 1e3, dm.optimizer_s * 1e3,
                  plain.optimizer_s / dm.optimizer_s, gather.optimizer_s / dm.optimizer_s, adamw.step_s * 1e3,
                  plain.step_s * 1e3, dm.step_s * 1e3, 100 * (dm.step_s / adamw.step_s - 1),
                  plain.step_s / dm.step_s);
    }
    std::printf("\nwhere the optimizer step goes (ms: NS / elementwise updates / communication; launches inside):\n");
    for (const auto& r : results) {
      std::printf("%7d |", r.devices);
      for (const auto& [o, s] : r.steps)
        std::printf(" %s %.3g/%.3g/%.3g (%.3g)", sim::to_string(o).c_str(), s.optimizer_ns_s * 1e3,
                    s.optimizer_elementwise_s * 1e3, s.optimizer_comm_s * 1e3, s.optimizer_launch_s * 1e3);
      std::printf("\n");
    }
    print_memory(results);
    if (options.mesh) print_mesh_ranks(*options.mesh, {results.front().plan});
  }
  if (!a.plot.empty()) {
    write_plot(results, a.plot, w.label + " on " + hw.name);
    std::fprintf(stderr, "plot written to %s\n", a.plot.c_str());
  }
}

Registration reg("", [](CLI::App& app) {
  auto args = std::make_shared<SimulateArgs>();
  auto* c = app.add_subcommand("simulate", "Model one training step on a simulated cluster of devices");
  args->model.add_to(c);
  auto* devices = c->add_option("--devices", args->devices, "Device counts to simulate (any from 1)")
                      ->delimiter(',')
                      ->capture_default_str()
                      ->check(at_least(1));
  args->mesh.add_to(c)->excludes(devices);
  args->muon_groups.add_to(c);
  c->add_option("--gpus-per-node", args->per_node, "Devices per node")->capture_default_str()->check(at_least(1));
  c->add_option("--profile", args->profile, "Hardware profile: a800, h200, or a path (models/hardware/*.json)")
      ->capture_default_str();
  auto* tokens = c->add_option("--tokens-per-device", args->tokens, "Tokens each device processes per step")
                     ->capture_default_str()
                     ->check(positive());
  c->add_option("--balancer", args->balancer, "DMuon owner assignment: rr, lpt or milp")
      ->capture_default_str()
      ->check(CLI::IsMember({"rr", "lpt", "milp"}));
  auto* gpt = c->add_option("--gpt", args->gpt,
                             "Model the GPT example of `dmuon bench e2e` instead of --model: demo or large (default: none)")
                  ->check(CLI::IsMember({"demo", "large"}))
                  ->excludes(tokens);
  c->add_option("--batch", args->batch,
                "With --gpt: sequences per step over all devices (default: the configuration's, as bench e2e)")
      ->check(at_least<int64_t>(1))
      ->needs(gpt);
  c->add_option("--memory-balance", args->memory_balance,
                "DMuon's owners: let the plan's makespan grow by up to this fraction to lower the fullest rank's bytes "
                "(0: time alone; dmuon plan --memory-balance)")
      ->capture_default_str()
      ->check(at_least(0.0));
  c->add_flag("--zero2", args->zero2, "Keep gathered weights for backward (Z2) instead of gathering again (Z3)");
  c->add_flag("--json", args->json, "Print one JSON object instead of the table");
  c->add_option("--plot", args->plot, "Also draw speedup and step time against devices into this PNG (default: none)");
  c->add_option("--progress", args->progress, "Progress on stderr: auto (live on a terminal, else plain, or none with --json), live or plain")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "live", "plain"}));
  c->callback([args] { run(*args); });
});

}  // namespace simulate

}  // namespace dmuon::cli
