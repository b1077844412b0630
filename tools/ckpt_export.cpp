// dmuon ckpt export --in DIR --out DIR: every parameter of a checkpoint as <name>.npy (float32, its
// full logical shape), assembled from however many ranks saved it. Optimizer state is not exported.
#include <cstdio>

#include "cli_kit/cli.hpp"
#include "dmuon/checkpoint.hpp"
#include "dmuon/checkpoint_rotation.hpp"

namespace ckpt_export {

dmuon::cli::Registration reg("ckpt", [](CLI::App& ckpt) {
  auto* c = ckpt.add_subcommand("export", "Write every parameter of a checkpoint as a .npy file");
  auto in = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  c->add_option("--in", *in, "checkpoint folder (with index.json), or a --save folder (its newest checkpoint)")->required();
  c->add_option("--out", *out, "folder for <parameter>.npy files (created)")->required();
  c->callback([in, out] {
    const std::string checkpoint = dmuon::newest_checkpoint(*in);
    const size_t n = dmuon::export_checkpoint_npy(checkpoint, *out);
    std::printf("exported %zu parameters from %s to %s\n", n, checkpoint.c_str(), out->c_str());
  });
});

}  // namespace ckpt_export
