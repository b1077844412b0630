// dmuon simulate: one training step of a real model on a simulated cluster of 8…256 devices, for
// each optimizer (adamw, muon-gather-plain, muon-gather, dmuon). See include/dmuon/sim.hpp.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli.hpp"
#include "model_args.hpp"
#include "dmuon/models.hpp"
#include "dmuon/plot.hpp"
#include "dmuon/sim.hpp"

namespace dmuon::cli {

namespace {

struct SimulateArgs {
  ModelArgs model;
  std::vector<int> devices = {8, 16, 32, 64, 128, 256};
  int per_node = 8;
  std::string profile = "a800";
  double tokens = 4096;
  std::string balancer = "milp";
  bool zero2 = false;
  bool json = false;
  std::string plot;
};

void print_assumptions(const sim::HardwareProfile& hw, const SimulateArgs& a) {
  std::printf("Hardware profile %s: %s\n", hw.name.c_str(), hw.description.c_str());
  std::printf("  peak %.0f TFLOP/s at MFU %.0f%%; NS at %.0f TFLOP/s x %.0f%%; HBM %.0f GB/s; %d SMs\n",
              hw.peak_flops / 1e12, 100 * hw.mfu, hw.ns_flops / 1e12, 100 * hw.ns_efficiency,
              hw.hbm_bytes_per_s / 1e9, hw.sm_count);
  std::printf("  NVLink %.0f GB/s per device, network %.0f GB/s per node, latency %.0f/%.0f us, launch %.0f us\n",
              hw.intra_node_bytes_per_s / 1e9, hw.inter_node_bytes_per_s / 1e9, hw.intra_node_latency_s * 1e6,
              hw.inter_node_latency_s * 1e6, hw.kernel_launch_s * 1e6);
  for (const auto& [field, source] : hw.sources) std::printf("  - %s: %s\n", field.c_str(), source.c_str());
  std::printf("Model: %s, %.0f tokens per device, %d devices per node, %s, owners by %s\n", a.model.label().c_str(),
              a.tokens, a.per_node,
              a.zero2 ? "Z2" : "Z3", a.balancer.c_str());
  std::printf("Model of the step: forward+backward = 6*params*tokens at peak*MFU (attention T^2 ignored); ring\n"
              "all-gather/reduce-scatter for FSDP units; DMuon: per-owner pipelined broadcast and two-stage reduce;\n"
              "one compute and one comm stream with one-unit prefetch; NS GEMMs on an HBM/SM-occupancy roofline.\n\n");
}

void write_plot(const std::vector<sim::SimResult>& results, const std::string& path, const std::string& title) {
  std::ostringstream data;
  for (const auto& r : results) {
    const auto& s = r.steps;
    data << r.devices << " " << s.at(sim::Optimizer::muon_gather_plain).optimizer_s / s.at(sim::Optimizer::dmuon).optimizer_s
         << " " << s.at(sim::Optimizer::adamw).step_s * 1e3 << " " << s.at(sim::Optimizer::muon_gather_plain).step_s * 1e3
         << " " << s.at(sim::Optimizer::dmuon).step_s * 1e3 << "\n";
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

void run(const SimulateArgs& a) {
  const std::vector<ParamSpec> params = a.model.load();
  const sim::HardwareProfile hw = sim::load_hardware_profile(a.profile);
  sim::SimOptions options;
  options.tokens_per_device = a.tokens;
  options.zero3 = !a.zero2;
  options.plan.balancer = parse_balancer(a.balancer);

  std::vector<sim::SimResult> results;
  for (int d : a.devices) {
    std::fprintf(stderr, "\rsimulating %d devices...", d);
    results.push_back(sim::simulate_step(params, hw, {d, a.per_node}, options));
  }
  std::fprintf(stderr, "\r%40s\r", "");

  if (a.json) {
    nlohmann::json out = {{"model", a.model.label()}, {"profile", hw.name},
                          {"tokens_per_device", a.tokens}, {"devices_per_node", a.per_node},
                          {"sources", hw.sources}, {"results", nlohmann::json::array()}};
    for (const auto& r : results) {
      nlohmann::json row = {{"devices", r.devices}, {"plan_gap_pct", r.plan.gap_pct},
                            {"plan_balancer", to_string(r.plan.balancer)}, {"plan_fell_back", r.plan.fell_back}};
      for (const auto& [o, s] : r.steps) {
        row[sim::to_string(o)] = {{"step_s", s.step_s},           {"compute_s", s.compute_s},
                                  {"exposed_comm_s", s.exposed_comm_s}, {"optimizer_s", s.optimizer_s},
                                  {"optimizer_comm_s", s.optimizer_comm_s}, {"bytes_per_device", s.bytes_per_device}};
      }
      out["results"].push_back(row);
    }
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    print_assumptions(hw, a);
    std::printf("%7s | %-33s | %-17s | %-32s | %s\n", "", "optimizer step (ms)", "DMuon opt speedup",
                "training step (ms)", "DMuon e2e");
    std::printf("%7s | %10s %10s %10s | %8s %8s | %10s %10s %10s | %9s %9s\n", "devices", "gath-plain", "gather",
                "dmuon", "vs plain", "vs gath", "adamw", "gath-plain", "dmuon", "vs adamw", "vs plain");
    for (const auto& r : results) {
      const auto& s = r.steps;
      const auto& plain = s.at(sim::Optimizer::muon_gather_plain);
      const auto& gather = s.at(sim::Optimizer::muon_gather);
      const auto& dm = s.at(sim::Optimizer::dmuon);
      const auto& adamw = s.at(sim::Optimizer::adamw);
      std::printf("%7d | %10.2f %10.2f %10.2f | %7.2fx %7.2fx | %10.2f %10.2f %10.2f | %+8.1f%% %8.2fx\n", r.devices,
                  plain.optimizer_s * 1e3, gather.optimizer_s * 1e3, dm.optimizer_s * 1e3,
                  plain.optimizer_s / dm.optimizer_s, gather.optimizer_s / dm.optimizer_s, adamw.step_s * 1e3,
                  plain.step_s * 1e3, dm.step_s * 1e3, 100 * (dm.step_s / adamw.step_s - 1),
                  plain.step_s / dm.step_s);
    }
  }
  if (!a.plot.empty()) {
    write_plot(results, a.plot, a.model.label() + " on " + hw.name);
    std::fprintf(stderr, "plot written to %s\n", a.plot.c_str());
  }
}

Registration reg("", [](CLI::App& app) {
  auto args = std::make_shared<SimulateArgs>();
  auto* c = app.add_subcommand("simulate", "Model one training step on a simulated cluster (8-256 devices)");
  args->model.add_to(c);
  c->add_option("--devices", args->devices, "Device counts to simulate")
      ->delimiter(',')
      ->capture_default_str()
      ->check(at_least(1));
  c->add_option("--gpus-per-node", args->per_node, "Devices per node")->capture_default_str()->check(at_least(1));
  c->add_option("--profile", args->profile, "Hardware profile: a800, h200, or a path (models/hardware/*.json)")
      ->capture_default_str();
  c->add_option("--tokens-per-device", args->tokens, "Tokens each device processes per step")
      ->capture_default_str()
      ->check(positive());
  c->add_option("--balancer", args->balancer, "DMuon owner assignment: rr, lpt or milp")->capture_default_str();
  c->add_flag("--zero2", args->zero2, "Keep gathered weights for backward (Z2) instead of gathering again (Z3)");
  c->add_flag("--json", args->json, "Print one JSON object instead of the table");
  c->add_option("--plot", args->plot, "Also draw speedup and step time against devices into this PNG");
  c->callback([args] { run(*args); });
});

}  // namespace

}  // namespace dmuon::cli
