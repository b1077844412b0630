// Checkpoints of parameters and optimizer state, loadable at any world size or sharding.
//
// A checkpoint is a folder:
//   rank-00000.safetensors   one per saving rank: every local slice it holds, as F32 tensors named
//                            "<kind>/<parameter>@<offset>" of shape [count]; kind is one of
//                            param | muon.momentum | adamw.m | adamw.v
//   rank-00000.json          that rank's manifest: the file's size and FNV-1a 64 checksum
//                            (include/dmuon/checksum.hpp), and per slice the parameter, kind, full
//                            logical shape, global offset (flattened, row-major) and count
//   index.json               written last by rank 0 once every rank has finished: format, version,
//                            world size, update and skip counters, each manifest's size and checksum,
//                            and "index_fnv1a64", the checksum of the index's own values (its JSON
//                            without that field, as nlohmann::json dumps it: sorted keys, no spaces).
//                            A folder without it is incomplete.
// So every byte that affects a loaded value is covered by a checksum: the index by its own, each
// manifest by the index's, each data file by its manifest's. A flipped digit in a counter, a shape
// or an offset is refused like a flipped bit in a tensor.
// Every file is written atomically (temporary file, fsync, rename).
//
// A save never touches the previous checkpoint until the new one is complete: every rank writes its
// files into the sibling folder <dir>.new; once all ranks agree that all succeeded, rank 0 writes
// <dir>.new/index.json, renames <dir> to <dir>.old and <dir>.new to <dir>, and removes <dir>.old.
// Where a crash leaves things, and what happens next:
//   - before the first rename: <dir> is the old checkpoint, untouched; <dir>.new is debris, which the
//     next save reuses (its index.json removed first, files of ranks beyond its world size dropped).
//   - between the renames: no <dir>; <dir>.old (old) and <dir>.new (new, complete). Loading `dir`
//     then reads <dir>.new if it holds an index.json, else <dir>.old; the next save first renames
//     that folder back to <dir>.
//   - after the second rename: <dir> is the new checkpoint; <dir>.old is removed by the next save.
// Because these folders are replaced or removed whole, a save refuses a <dir>, <dir>.new or <dir>.old
// that holds files other than a checkpoint's.
//
// Loading reads the manifests, and for each slice this rank now holds, copies the saved slices that
// cover it (so a checkpoint saved at 4 ranks resumes at 2 or 1, or under another owner plan). It
// checks every file's size and checksum, every tensor's dtype, shape and coverage, and that the set
// of parameters and their optimizer groups match; any mismatch is a dmuon::Error naming the file and
// the tensor, raised on every rank, and then nothing in memory has changed (everything is loaded and
// validated before anything is copied into place).
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "dmuon/optim.hpp"

namespace dmuon {

// The options of the run that saved a checkpoint, field name → value text (the Trainer records the
// TrainOptions fields that decide whether a resumed run continues it exactly: seed, batch, the schedule...).
// Kept in index.json, under its checksum; empty when the saver recorded none. Checkpoints written before
// the records were keyed by field names spelled them as flags ("--micro-batches"): reading gives the field
// names ("micro_batches").
using CheckpointRun = std::map<std::string, std::string>;

// Collective over the optimizer's ranks. Throws if called between micro-batches of one update.
// CheckpointWriter's three phases in a row.
void save_checkpoint(const std::string& dir, Optimizer& optimizer, const CheckpointRun& run = {});
// Before any work: throws the dmuon::Error save_checkpoint(dir) would raise for the folder itself (it, or
// its <dir>.new or <dir>.old sibling, holds files that are not part of a checkpoint; the folder above
// cannot be written), touching nothing. One process's check; call it on rank 0.
void check_checkpoint_destination(const std::string& dir);

// A save in three phases, so that the files can be written while training goes on:
//   constructor  collective: rank 0 prepares the folders; each rank copies its state (memory: one
//                copy of this rank's parameters and optimizer state), after which the optimizer may
//                update again
//   write()      this rank's files into <dir>.new; no communication, so it may run on another thread
//   finish()     collective: every rank learns whether every write succeeded; rank 0 writes the
//                index and swaps the checkpoint into place. Throws on every rank if any failed.
// Every rank calls the constructor and finish() in the same order as its other collectives.
class CheckpointWriter {
 public:
  CheckpointWriter(const std::string& dir, Optimizer& optimizer, CheckpointRun run = {});
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  void write() noexcept;  // a failure is kept for finish()
  // after_swap: run by rank 0 once the checkpoint is in place (pruning older ones); its failure
  // fails the save on every rank.
  void finish(const std::function<void()>& after_swap = {});
  const std::string& dir() const { return target_; }

 private:
  struct Slice;
  Optimizer& optimizer_;
  std::string target_;
  int rank_ = 0, world_size_ = 1;
  int64_t updates_ = 0, skipped_ = 0;
  CheckpointRun run_;
  std::vector<Slice> slices_;
  std::exception_ptr failure_;
};

// Whether `dir` names a complete checkpoint (its index.json exists, possibly in <dir>.new or
// <dir>.old after a save that died between its renames); says nothing about its checksums.
bool is_checkpoint(const std::string& dir);
// Collective over the optimizer's ranks.
void load_checkpoint(const std::string& dir, Optimizer& optimizer);

// What a checkpoint holds, from its JSON files alone (no tensor data is read): the step counters and,
// per parameter, its full shape and the kinds of state saved for it ("param", "muon.momentum", ...).
// For checks before work starts (dmuon train --resume). Throws dmuon::Error naming what is missing or
// malformed.
struct CheckpointContents {
  int64_t updates = 0, skipped = 0;
  struct Param {
    std::vector<int64_t> shape;
    std::set<std::string> kinds;
  };
  std::map<std::string, Param> params;
  CheckpointRun run;  // the saving run's options, as recorded
  int64_t steps() const { return updates + skipped; }  // optimizer steps taken
};
CheckpointContents read_checkpoint_contents(const std::string& dir);

struct CheckpointTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;  // the full logical tensor, C order
};
// Every saved tensor of one kind ("param" for the weights), assembled whole from its slices; for
// tools (dmuon ckpt export). Validates like load_checkpoint.
std::map<std::string, CheckpointTensor> read_checkpoint_tensors(const std::string& dir, const std::string& kind);

// Writes every parameter of the checkpoint in `dir` as `out_dir`/<name>.npy (float32, full shape;
// `out_dir` is created); returns how many. A name that cannot be a file name is an error.
size_t export_checkpoint_npy(const std::string& dir, const std::string& out_dir);

}  // namespace dmuon
