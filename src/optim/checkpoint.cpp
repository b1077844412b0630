// Checkpoint save/load (layout and guarantees in include/dmuon/checkpoint.hpp).
#include "dmuon/checkpoint.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "dmuon/atomic_file.hpp"
#include "dmuon/checksum.hpp"
#include "dmuon/error.hpp"
#include "io/fault_injection.hpp"
#include "dmuon/npy.hpp"
#include "dmuon/rank_agreement.hpp"
#include "dmuon/safetensors.hpp"
#include "dmuon/shape.hpp"
#include "io/json_file.hpp"

namespace dmuon {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kFormat = "dmuon-checkpoint";
constexpr const char* kRowStateKind = "normuon.v";  // one value per row of the parameter (Optimizer::state_slices)
constexpr int kVersion = 2;  // 2: index.json covers itself and the manifests by checksums

std::string rank_stem(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d", rank);
  return buf;
}

// "ck/" -> "ck", so that "<dir>.new" is a sibling.
std::string folder_name(const std::string& dir) {
  fs::path p(dir);
  if (!p.has_filename() && p.has_parent_path()) p = p.parent_path();
  return p.string();
}

// Where a save stages the new checkpoint, and where it parks the old one during the swap.
std::string staging_folder(const std::string& dir) { return dir + ".new"; }
std::string old_folder(const std::string& dir) { return dir + ".old"; }

bool is_complete(const std::string& dir) { return fs::exists(dir + "/index.json"); }

// The folder holding the checkpoint named `dir`: `dir` itself, or, after a save that died between
// its two renames (`dir` then missing), the complete new one in <dir>.new or else the old one in
// <dir>.old. Anything else is `dir` (and loading it reports what is missing).
std::string complete_folder(const std::string& dir_arg) {
  const std::string dir = folder_name(dir_arg);
  if (fs::exists(dir)) return dir;
  if (is_complete(staging_folder(dir))) return staging_folder(dir);
  if (is_complete(old_folder(dir))) return old_folder(dir);
  return dir;
}

// rank-00000.json or rank-00000.safetensors (the rank in group 1).
const std::regex kRankFile(R"(rank-(\d{5,})\.(json|safetensors))");
// write_file_atomically's temporary: .<name>.tmp.XXXXXX
const std::regex kTemporaryFile(R"(\..*\.tmp\..*)");

// A file a save may replace: one it wrote itself, or write_file_atomically's leftover temporary.
bool is_checkpoint_file(const std::string& name) {
  return name == "index.json" || std::regex_match(name, kRankFile) || std::regex_match(name, kTemporaryFile);
}

// A save replaces or removes `folder` whole (if it exists): it must hold nothing but checkpoint files.
void check_replaceable(const std::string& folder) {
  if (!fs::exists(folder)) return;
  DMUON_CHECK(fs::is_directory(folder), folder,
              ": exists and is not a folder; refusing to replace it with a checkpoint");
  for (const auto& entry : fs::directory_iterator(folder)) {
    const std::string name = entry.path().filename().string();
    DMUON_CHECK(is_checkpoint_file(name), folder, ": holds '", name,
                "', which is not part of a checkpoint; refusing to replace the folder");
  }
}

// Rank 0, before anything is written: finishes a swap an earlier save left half-done, refuses to
// replace folders that hold anything but a checkpoint, and marks a leftover staging folder incomplete.
void prepare_save(const std::string& dir) {
  if (!fs::exists(dir) && complete_folder(dir) != dir) rename_durably(complete_folder(dir), dir);
  for (const std::string& folder : {dir, staging_folder(dir), old_folder(dir)}) check_replaceable(folder);
  fs::remove(staging_folder(dir) + "/index.json");  // a staging folder is complete only once this save says so
}

// Rank 0, once every rank's files are in the staging folder: drops files of ranks beyond this save's
// world size (left by an earlier failed save), then replaces `dir` by the staging folder.
void swap_in(const std::string& dir, int world_size) {
  const std::string staging = staging_folder(dir), old = old_folder(dir);
  for (const auto& entry : fs::directory_iterator(staging)) {
    const std::string name = entry.path().filename().string();
    if (name == "index.json") continue;
    std::smatch m;
    const bool ours = std::regex_match(name, m, kRankFile) && m[1].length() < 10 && std::stoi(m[1]) < world_size;
    if (!ours) fs::remove_all(entry.path());
  }
  fs::remove_all(old);
  if (fs::exists(dir)) rename_durably(dir, old);
  rename_durably(staging, dir);
  fs::remove_all(old);
  fault::point("removed the replaced checkpoint");
}

// Every rank raises if any rank failed (so none goes on alone into a collective); the failing rank
// raises its own error, the others a pointer to it. The flags are summed through the optimizer, whose
// ranks are the checkpoint's.
void agree(Optimizer& optimizer, const std::exception_ptr& failure, const std::string& what) {
  double failed[1] = {failure ? 1.0 : 0.0};
  optimizer.sum_across_ranks(failed);
  comm::throw_if_any_failed(failure, failed[0], optimizer.rank(),
                            what + " failed on another rank (its error says why)");
}

struct SavedSlice {
  std::string param, kind, key;
  std::vector<int64_t> shape;
  int64_t offset = 0, count = 0;
  int rank = 0;  // whose file holds it
};

struct SavedFile {
  std::string path;
  uint64_t bytes = 0;
  std::string checksum;
};

struct Manifest {
  int world_size = 0;
  int64_t updates = 0, skipped = 0;
  CheckpointRun run;
  std::vector<SavedFile> files;  // indexed by rank
  std::vector<SavedSlice> slices;
};

// The index without its own checksum field, as the text the checksum covers: nlohmann::json dumps
// an object's keys sorted and numbers canonically, so any change of a value changes this text.
std::string index_checksum(json index) {
  index.erase("index_fnv1a64");
  return fnv1a64_hex(index.dump());
}

// The bytes of `path`, which `listed_by` says has `bytes` bytes and FNV-1a 64 checksum `sum`.
std::string read_checked(const std::string& path, uint64_t bytes, const std::string& sum,
                         const std::string& listed_by) {
  DMUON_CHECK(fs::exists(path), path, ": missing (the checkpoint is incomplete)");
  const std::string text = read_file(path);
  DMUON_CHECK(text.size() == bytes, path, ": ", text.size(), " bytes, ", listed_by, " says ", bytes,
              " (truncated or replaced file)");
  const std::string actual = fnv1a64_hex(text);
  DMUON_CHECK(actual == sum, path, ": checksum mismatch (FNV-1a 64 ", actual, ", ", listed_by, " says ", sum,
              "): the file is corrupt");
  return text;
}

json read_json(const std::string& path) {
  DMUON_CHECK(fs::exists(path), path, ": missing (the checkpoint is incomplete or not a dmuon checkpoint)");
  return read_json_file(path);
}

// Checkpoints written before the run records were keyed by field names spelled them as dmuon train's
// flags ("--micro-batches"): read as the field names they stand for ("micro_batches").
CheckpointRun with_field_names(const CheckpointRun& recorded) {
  CheckpointRun run;
  for (const auto& [key, value] : recorded) {
    if (key.rfind("--", 0) != 0) {
      run[key] = value;
      continue;
    }
    std::string field = key.substr(2);
    std::replace(field.begin(), field.end(), '-', '_');
    run[field] = value;
  }
  return run;
}

Manifest read_manifest(const std::string& dir) {
  Manifest m;
  const std::string index_path = dir + "/index.json";
  const json index = read_json(index_path);
  DMUON_CHECK(index.is_object() && index.value("format", "") == kFormat, index_path, ": not a ", kFormat, " index");
  const int version = json_field<int>(index, "version", index_path, "the index");
  DMUON_CHECK(version == kVersion, index_path, ": version ", version, " (this build reads version ", kVersion, ")");
  m.world_size = json_field<int>(index, "world_size", index_path, "the index");
  m.updates = json_field<int64_t>(index, "updates", index_path, "the index");
  m.skipped = json_field<int64_t>(index, "skipped", index_path, "the index");
  const std::string sum = json_field<std::string>(index, "index_fnv1a64", index_path, "the index");
  DMUON_CHECK(index_checksum(index) == sum, index_path, ": checksum mismatch (FNV-1a 64 of its values ",
              index_checksum(index), ", the file says ", sum, "): the index is corrupt");
  if (index.contains("run")) m.run = with_field_names(json_field<CheckpointRun>(index, "run", index_path, "the index"));
  DMUON_CHECK(m.world_size >= 1 && m.updates >= 0 && m.skipped >= 0, index_path,
              ": world_size must be ≥ 1 and counters ≥ 0");
  const auto manifests = json_field<std::vector<json>>(index, "manifests", index_path, "the index");
  DMUON_CHECK(manifests.size() == static_cast<size_t>(m.world_size), index_path, ": ", manifests.size(),
              " manifests for world_size ", m.world_size);
  for (int r = 0; r < m.world_size; ++r) {
    const std::string path = dir + "/" + rank_stem(r) + ".json";
    const json& listed = manifests[r];
    DMUON_CHECK(listed.is_object() && listed.value("file", "") == rank_stem(r) + ".json", index_path,
                ": manifest ", r, " is not listed as ", rank_stem(r), ".json");
    const std::string text = read_checked(path, json_field<uint64_t>(listed, "bytes", index_path, "a manifest entry"),
                                          json_field<std::string>(listed, "fnv1a64", index_path, "a manifest entry"),
                                          "the index");
    const json j = parse_json(text, path);
    SavedFile f;
    DMUON_CHECK(j.is_object(), path, ": the manifest is not a JSON object");
    f.path = dir + "/" + json_field<std::string>(j, "file", path, "the manifest");
    f.bytes = json_field<uint64_t>(j, "bytes", path, "the manifest");
    f.checksum = json_field<std::string>(j, "fnv1a64", path, "the manifest");
    m.files.push_back(f);
    DMUON_CHECK(j.contains("slices") && j["slices"].is_array(), path, ": the manifest lacks a 'slices' array");
    for (const json& s : j["slices"]) {
      SavedSlice slice;
      slice.param = json_field<std::string>(s, "param", path, "a slice");
      slice.kind = json_field<std::string>(s, "kind", path, "slice of '" + slice.param + "'");
      slice.key = json_field<std::string>(s, "key", path, "slice of '" + slice.param + "'");
      slice.shape = json_field<std::vector<int64_t>>(s, "shape", path, "tensor '" + slice.key + "'");
      slice.offset = json_field<int64_t>(s, "offset", path, "tensor '" + slice.key + "'");
      slice.count = json_field<int64_t>(s, "count", path, "tensor '" + slice.key + "'");
      slice.rank = r;
      const int64_t numel = checked_numel(slice.shape, path + ": tensor '" + slice.key + "'");
      DMUON_CHECK(slice.offset >= 0 && slice.count >= 0 && slice.offset <= numel && slice.count <= numel - slice.offset,
                  path, ": tensor '", slice.key, "' covers ", slice.count, " elements from offset ", slice.offset,
                  ", outside its shape ", shape_text(slice.shape));
      // Checked before anything is allocated for it: a slice cannot hold more values than its file has bytes.
      DMUON_CHECK(static_cast<uint64_t>(slice.count) <= f.bytes / sizeof(float), path, ": tensor '", slice.key,
                  "' claims ", slice.count, " values, more than its file's ", f.bytes, " bytes hold");
      m.slices.push_back(std::move(slice));
    }
  }
  return m;
}

// Reads each rank file at most once, checking its size and checksum against the manifest first.
class SliceReader {
 public:
  explicit SliceReader(const Manifest& m) : manifest_(m) {}

  std::vector<float> values(const SavedSlice& s) {
    const SavedFile& f = manifest_.files[s.rank];
    auto it = files_.find(s.rank);
    if (it == files_.end()) {
      const std::string bytes = read_checked(f.path, f.bytes, f.checksum, "the manifest");
      it = files_.emplace(s.rank, decode_safetensors(bytes, f.path)).first;
    }
    std::vector<float> v = get_f32(it->second, s.key, f.path);
    DMUON_CHECK(static_cast<int64_t>(v.size()) == s.count, f.path, ": tensor '", s.key, "' holds ", v.size(),
                " values, the manifest says ", s.count);
    return v;
  }

 private:
  const Manifest& manifest_;
  std::map<int, SafetensorsFile> files_;
};

// out = elements [offset, offset+count) of the saved (param, kind), copied from the saved slices
// that overlap it; every element must be covered.
void assemble(const Manifest& m, SliceReader& reader, const std::string& dir, const std::string& param,
              const std::string& kind, const std::vector<int64_t>& shape, int64_t offset, int64_t count, float* out) {
  std::vector<char> covered(count, 0);
  bool found = false;
  for (const SavedSlice& s : m.slices) {
    if (s.param != param || s.kind != kind) continue;
    found = true;
    DMUON_CHECK(s.shape == shape, m.files[s.rank].path, ": tensor '", s.key, "' has shape ", shape_text(s.shape),
                ", the model's '", param, "' has ", shape_text(shape));
    const int64_t lo = std::max(offset, s.offset), hi = std::min(offset + count, s.offset + s.count);
    if (lo >= hi) continue;
    const std::vector<float> v = reader.values(s);
    std::copy(v.begin() + (lo - s.offset), v.begin() + (hi - s.offset), out + (lo - offset));
    std::fill(covered.begin() + (lo - offset), covered.begin() + (hi - offset), 1);
  }
  DMUON_CHECK(found, dir, ": the checkpoint has no ", kind, " for parameter '", param,
              "' (saved with another model or parameter groups?)");
  for (int64_t i = 0; i < count; ++i) {
    DMUON_CHECK(covered[i], dir, ": the checkpoint lacks element ", offset + i, " of ", kind, " '", param, "'");
  }
}

}  // namespace

bool is_checkpoint(const std::string& dir) { return is_complete(complete_folder(dir)); }

struct CheckpointWriter::Slice {
  std::string param, kind;
  std::vector<int64_t> shape;
  int64_t offset = 0;
  std::vector<float> values;
};

CheckpointWriter::CheckpointWriter(const std::string& dir_arg, Optimizer& optimizer, CheckpointRun run)
    : optimizer_(optimizer), target_(folder_name(dir_arg)), run_(std::move(run)) {
  DMUON_CHECK(!optimizer.accumulating(), "saving checkpoint ", dir_arg,
              ": called between micro-batches of one update; save after the update");
  rank_ = optimizer.rank();
  world_size_ = optimizer.world_size();
  updates_ = optimizer.updates();
  skipped_ = optimizer.skipped_steps();
  const std::exception_ptr failure = comm::capture_failure(
      [&] {
        if (rank_ == 0) prepare_save(target_);
      },
      target_ + ": cannot prepare the checkpoint folder");
  agree(optimizer, failure, "preparing checkpoint " + target_);  // orders rank 0's preparation before any write
  for (const StateSlice& s : optimizer.state_slices()) {
    if (s.count == 0) continue;  // a parameter this rank holds nothing of (another rank saves it)
    std::vector<float> values(s.count);  // from the optimizer's backend memory (a GPU's, say)
    optimizer.backend().copy_to_host(values.data(), s.data, sizeof(float) * values.size());
    slices_.push_back({s.param, s.kind, s.shape, s.offset, std::move(values)});
  }
}

CheckpointWriter::~CheckpointWriter() = default;

void CheckpointWriter::write() noexcept {
  const std::string staging = staging_folder(target_);
  failure_ = comm::capture_failure([&] {
    fs::create_directories(staging);
    SafetensorsFile file;
    file.metadata["format"] = kFormat;
    json slices = json::array();
    for (const Slice& s : slices_) {
      const int64_t count = static_cast<int64_t>(s.values.size());
      const std::string key = s.kind + "/" + s.param + "@" + std::to_string(s.offset);
      file.tensors[key] = f32_tensor({count}, s.values.data());
      slices.push_back({{"param", s.param}, {"kind", s.kind}, {"key", key}, {"shape", s.shape},
                        {"offset", s.offset}, {"count", count}});
    }
    slices_.clear();
    slices_.shrink_to_fit();
    const std::string bytes = encode_safetensors(file);
    const std::string stem = rank_stem(rank_);
    write_file_atomically(staging + "/" + stem + ".safetensors", bytes);
    const json manifest = {{"file", stem + ".safetensors"},
                           {"bytes", bytes.size()},
                           {"fnv1a64", fnv1a64_hex(bytes)},
                           {"slices", slices}};
    write_file_atomically(staging + "/" + stem + ".json", manifest.dump(1));
  }, staging + ": cannot write rank " + std::to_string(rank_) + "'s files");
}

void CheckpointWriter::finish(const std::function<void()>& after_swap) {
  agree(optimizer_, failure_, "writing checkpoint " + target_);
  std::exception_ptr failure;
  if (rank_ == 0) {
    failure = comm::capture_failure([&] {
      const std::string staging = staging_folder(target_);
      json manifests = json::array();
      for (int r = 0; r < world_size_; ++r) {  // every rank's manifest is complete: all agreed
        const std::string name = rank_stem(r) + ".json";
        const std::string bytes = read_file(staging + "/" + name);
        manifests.push_back({{"file", name}, {"bytes", bytes.size()}, {"fnv1a64", fnv1a64_hex(bytes)}});
      }
      json index = {{"format", kFormat},     {"version", kVersion}, {"world_size", world_size_},
                    {"updates", updates_},   {"skipped", skipped_}, {"checksum", "fnv1a64"},
                    {"manifests", manifests}};
      if (!run_.empty()) index["run"] = run_;
      index["index_fnv1a64"] = index_checksum(index);
      write_file_atomically(staging + "/index.json", index.dump(1));
      swap_in(target_, world_size_);
      if (after_swap) after_swap();
    }, target_ + ": cannot move the new checkpoint into place");
  }
  agree(optimizer_, failure, "finishing checkpoint " + target_);
}

void save_checkpoint(const std::string& dir, Optimizer& optimizer, const CheckpointRun& run) {
  CheckpointWriter writer(dir, optimizer, run);
  writer.write();
  writer.finish();
}

void check_checkpoint_destination(const std::string& dir_arg) {
  const std::string dir = folder_name(dir_arg);
  for (const std::string& folder : {dir, staging_folder(dir), old_folder(dir)}) check_replaceable(folder);
  const std::string why = why_cannot_write(dir, true);
  DMUON_CHECK(why.empty(), "cannot write checkpoint ", dir, ": ", why);
}

void load_checkpoint(const std::string& dir, Optimizer& optimizer) {
  std::vector<StateSlice> targets = optimizer.state_slices();
  std::vector<std::vector<float>> staged(targets.size());
  Manifest manifest;
  const std::exception_ptr failure = comm::capture_failure([&] {
    manifest = read_manifest(complete_folder(dir));
    SliceReader reader(manifest);
    std::set<std::string> ours;
    for (size_t i = 0; i < targets.size(); ++i) {
      const StateSlice& t = targets[i];
      ours.insert(t.param);
      staged[i].resize(t.count);
      assemble(manifest, reader, dir, t.param, t.kind, t.shape, t.offset, t.count, staged[i].data());
    }
    for (const SavedSlice& s : manifest.slices) {
      DMUON_CHECK(ours.count(s.param), manifest.files[s.rank].path, ": tensor '", s.key, "' belongs to parameter '",
                  s.param, "', which the model does not have");
    }
  }, dir + ": cannot load the checkpoint");
  agree(optimizer, failure, "loading checkpoint " + dir);
  // Everything validated on every rank: commit.
  for (size_t i = 0; i < targets.size(); ++i)
    if (!staged[i].empty())
      optimizer.backend().copy_from_host(targets[i].data, staged[i].data(), sizeof(float) * staged[i].size());
  optimizer.set_counters(manifest.updates, manifest.skipped);
}

CheckpointContents read_checkpoint_contents(const std::string& dir) {
  const Manifest manifest = read_manifest(complete_folder(dir));
  CheckpointContents out;
  out.updates = manifest.updates;
  out.skipped = manifest.skipped;
  out.run = manifest.run;
  for (const SavedSlice& s : manifest.slices) {
    if (s.kind == kRowStateKind) continue;  // laid out as the rows: shape {rows}, checked below
    CheckpointContents::Param& p = out.params[s.param];
    DMUON_CHECK(p.kinds.empty() || p.shape == s.shape, dir, ": parameter '", s.param, "' is saved with shapes ",
                shape_text(p.shape), " and ", shape_text(s.shape));
    p.shape = s.shape;
    p.kinds.insert(s.kind);
  }
  for (const SavedSlice& s : manifest.slices) {
    if (s.kind != kRowStateKind) continue;
    const auto p = out.params.find(s.param);
    DMUON_CHECK(p != out.params.end() && !p->second.shape.empty() && s.shape == std::vector<int64_t>{p->second.shape[0]},
                dir, ": ", s.kind, " of parameter '", s.param, "' has shape ", shape_text(s.shape),
                ", not one value per row of the parameter's");
    p->second.kinds.insert(s.kind);
  }
  return out;
}

std::map<std::string, CheckpointTensor> read_checkpoint_tensors(const std::string& dir, const std::string& kind) {
  const Manifest manifest = read_manifest(complete_folder(dir));
  SliceReader reader(manifest);
  std::map<std::string, CheckpointTensor> out;
  for (const SavedSlice& s : manifest.slices) {
    if (s.kind != kind || out.count(s.param)) continue;
    // Only as many values as the slices hold can be covered: refuse before allocating the whole tensor.
    const int64_t numel = checked_numel(s.shape, dir + ": tensor '" + s.key + "'");
    int64_t held = 0;
    for (const SavedSlice& o : manifest.slices) held += o.param == s.param && o.kind == kind ? o.count : 0;
    DMUON_CHECK(held >= numel, dir, ": the checkpoint holds ", held, " of the ", numel, " elements of ", kind, " '",
                s.param, "' ", shape_text(s.shape));
    CheckpointTensor& t = out[s.param];
    t.shape = s.shape;
    t.data.resize(numel);
    assemble(manifest, reader, dir, s.param, kind, s.shape, 0, numel, t.data.data());
  }
  return out;
}

size_t export_checkpoint_npy(const std::string& dir, const std::string& out_dir) {
  const auto params = read_checkpoint_tensors(dir, "param");
  DMUON_CHECK(!params.empty(), dir, ": the checkpoint holds no parameters");
  // Every name checked before the first write, so a bad one leaves no half-written folder. (The
  // shapes were checked by read_checkpoint_tensors.)
  for (const auto& [name, tensor] : params) {
    DMUON_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..", dir,
                ": parameter '", name, "' cannot be a file name");
  }
  fs::create_directories(out_dir);
  for (const auto& [name, tensor] : params) {
    write_npy(out_dir + "/" + name + ".npy", tensor.shape, tensor.data.data());
  }
  return params.size();
}

}  // namespace dmuon
