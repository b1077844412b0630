// `dmuon ns`: orthogonalize one 2-D .npy matrix with Newton–Schulz and write the result as float32.
#include "dmuon/ns.hpp"

#include <memory>
#include <sstream>
#include <string>

#include "cli_kit/cli.hpp"
#include "cli_kit/device_args.hpp"
#include "dmuon/error.hpp"
#include "dmuon/npy.hpp"

namespace ns_command {

struct NsArgs {
  std::string in, out, algo = "auto", coeffs = "keller", restarts = "2";
  int steps = dmuon::NsOptions{}.steps, threads = 0, tiles = dmuon::NsOptions{}.tiles;
  double safety = 0.0;
  dmuon::cli::DeviceArgs device;
  bool restarts_given = false;
};

void run_ns(const NsArgs& args) {
  dmuon::NsOptions options;
  options.algo = dmuon::parse_ns_algo(args.algo);
  options.coeffs = dmuon::parse_ns_coeffs(args.coeffs);
  options.steps = args.steps;
  options.safety = args.safety;
  options.restarts = dmuon::parse_ns_restarts(args.restarts);
  options.dtype = args.device.iterates();
  if (options.dtype == dmuon::DType::bf16 && !args.restarts_given) options.restarts = {1, 3};  // DESIGN 2.2
  options.tiles = args.tiles;
  options.threads = args.threads;

  const dmuon::NpyArray g = dmuon::read_npy(args.in);
  if (g.shape.size() != 2) {
    std::ostringstream shape;
    for (size_t i = 0; i < g.shape.size(); ++i) shape << (i ? ", " : "") << g.shape[i];
    DMUON_FAIL(args.in, ": expected a 2-D matrix, got shape (", shape.str(), ")");
  }
  std::vector<float> o(g.data.size());
  dmuon::Backend& backend = args.device.backend();
  if (backend.host_memory() && options.dtype == dmuon::DType::f32) {
    dmuon::newton_schulz(g.data.data(), o.data(), g.shape[0], g.shape[1], options, args.in);
  } else {  // through the backend's memory
    const int64_t rows = g.shape[0], cols = g.shape[1];
    dmuon::Buffer in(backend, dmuon::DType::f32, rows * cols), out(backend, dmuon::DType::f32, rows * cols);
    in.upload(g.data);
    const dmuon::MatView u = in.view(rows, cols), v = out.view(rows, cols);
    const std::string name = args.in;
    dmuon::newton_schulz_batched(backend, std::span<const dmuon::MatView>(&u, 1), std::span<const dmuon::MatView>(&v, 1),
                                 options, std::span<const std::string>(&name, 1));
    out.download(o);
  }
  dmuon::write_npy(args.out, g.shape, o.data());
}

dmuon::cli::Registration reg("", [](CLI::App& app) {
  auto args = std::make_shared<NsArgs>();
  auto* c = app.add_subcommand("ns", "Orthogonalize a 2-D .npy matrix (float32/float64) with Newton-Schulz");
  c->add_option("--in", args->in, "input .npy (2-D, float32 or float64, C or Fortran order)")->required();
  c->add_option("--out", args->out, "output .npy (float32, same shape), written atomically")->required();
  c->add_option("--algo", args->algo, "standard | gram | auto (gram when max/min dimension >= 2)")
      ->capture_default_str();
  c->add_option("--coeffs", args->coeffs, "keller | you | polar-express")->capture_default_str();
  c->add_option("--steps", args->steps, "iterations; past the schedule's table its last row repeats")
      ->capture_default_str()
      ->check(dmuon::cli::at_least(0));
  c->add_option("--restarts", args->restarts,
                "Gram restart steps, comma-separated ('' or none: no restarts); bf16 default: 1,3")
      ->capture_default_str()
      ->each([args](const std::string&) { args->restarts_given = true; });
  c->add_option("--safety", args->safety, "safety factor s: (a,b,c) -> (a/s, b/s^3, c/s^5), norm*s; 0: default")
      ->capture_default_str()
      ->check(dmuon::cli::at_least(0.0));
  c->add_option("--tiles", args->tiles, "tiles per side of the upper-triangle products")
      ->capture_default_str()
      ->check(dmuon::cli::at_least(1));
  c->add_option("--threads", args->threads, "BLAS threads (0: OpenBLAS's setting)")
      ->capture_default_str()
      ->check(dmuon::cli::thread_count());
  args->device.add_to(c);
  c->callback([args] { run_ns(*args); });
});

}  // namespace ns_command
