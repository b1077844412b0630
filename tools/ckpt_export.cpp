// dmuon ckpt export --in DIR --out DIR: every parameter of a checkpoint as <name>.npy (float32, its
// full logical shape), assembled from however many ranks saved it. Optimizer state is not exported.
#include <cstdio>
#include <filesystem>

#include "cli.hpp"
#include "dmuon/checkpoint.hpp"
#include "dmuon/error.hpp"
#include "dmuon/npy.hpp"

namespace {

void export_checkpoint(const std::string& in, const std::string& out) {
  const auto params = dmuon::read_checkpoint_tensors(in, "param");
  DMUON_CHECK(!params.empty(), in, ": the checkpoint holds no parameters");
  std::filesystem::create_directories(out);
  for (const auto& [name, tensor] : params) {
    DMUON_CHECK(name.find('/') == std::string::npos && name != "." && name != "..", "parameter '", name,
                "' cannot be a file name");
    dmuon::write_npy(out + "/" + name + ".npy", tensor.shape, tensor.data.data());
  }
  std::printf("exported %zu parameters from %s to %s\n", params.size(), in.c_str(), out.c_str());
}

dmuon::cli::Registration reg("ckpt", [](CLI::App& ckpt) {
  auto* c = ckpt.add_subcommand("export", "Write every parameter of a checkpoint as a .npy file");
  auto in = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  c->add_option("--in", *in, "checkpoint folder (with index.json)")->required();
  c->add_option("--out", *out, "folder for <parameter>.npy files (created)")->required();
  c->callback([in, out] { export_checkpoint(*in, *out); });
});

}  // namespace
