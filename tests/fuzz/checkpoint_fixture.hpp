// Shared by the checkpoint fuzz targets: a small valid checkpoint (one rank, AdamW state for a
// 3x2 matrix and a 4-vector) saved once per process, and the way a fuzzed index.json or manifest
// replaces its file with every checksum that covers it made right again, so that inputs reach the
// parsing behind the checksums instead of stopping at them.
#pragma once

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dmuon/atomic_file.hpp"
#include "dmuon/checkpoint.hpp"
#include "dmuon/checksum.hpp"
#include "dmuon/optim.hpp"
#include "fuzz_input.hpp"

namespace dmuon::fuzz {

class CheckpointFixture {
 public:
  CheckpointFixture() : values_(10, 0.5f), grads_(10, 0.25f) {
    std::vector<ParamRef> refs = {{{"w", {3, 2}, ParamRole::matrix, 0}, values_.data(), grads_.data()},
                                  {{"b", {4}, ParamRole::elementwise, 0}, values_.data() + 6, grads_.data() + 6}};
    optimizer_ = std::make_unique<AdamW>(std::move(refs), OptimizerOptions{});
    optimizer_->step();
    dir_ = scratch_dir() + "/checkpoint";
    std::filesystem::remove_all(dir_);
    save_checkpoint(dir_, *optimizer_);
    index_ = read_file(dir_ + "/index.json");
    manifest_ = read_file(dir_ + "/rank-00000.json");
    // The seeds of corpus/checkpoint_index and corpus/checkpoint_manifest are copies of these.
    write_scratch("valid-index.json", index_);
    write_scratch("valid-rank-00000.json", manifest_);
  }

  // The checkpoint with `index` as its index.json (its own checksum set right when it parses).
  void use_index(std::string_view index) { write_file_atomically(dir_ + "/index.json", with_own_checksum(index)); }

  // The checkpoint with `manifest` as rank 0's manifest, listed with its size and checksum.
  void use_manifest(std::string_view manifest) {
    write_file_atomically(dir_ + "/rank-00000.json", manifest);
    nlohmann::json index = nlohmann::json::parse(index_);
    index["manifests"][0]["bytes"] = manifest.size();
    index["manifests"][0]["fnv1a64"] = fnv1a64_hex(manifest);
    write_file_atomically(dir_ + "/index.json", with_own_checksum(index.dump(1)));
  }

  // Everything a loader does with the folder: whole tensors for export, and a load into the optimizer.
  void load() {
    expect_only_dmuon_errors([&] { read_checkpoint_tensors(dir_, "param"); });
    expect_only_dmuon_errors([&] { load_checkpoint(dir_, *optimizer_); });
  }

 private:
  // checkpoint.hpp: "index_fnv1a64" is the checksum of the index's JSON without that field.
  static std::string with_own_checksum(std::string_view text) {
    nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return std::string(text);
    j.erase("index_fnv1a64");
    j["index_fnv1a64"] = fnv1a64_hex(j.dump());
    return j.dump(1);
  }

  std::vector<float> values_, grads_;
  std::unique_ptr<AdamW> optimizer_;
  std::string dir_, index_, manifest_;
};

}  // namespace dmuon::fuzz
