// A folder of periodic checkpoints (`dmuon train --save DIR --save-every N --keep K`): one
// checkpoint (checkpoint.hpp) per saved step, named by the step,
//   DIR/step-00000100/   DIR/step-00000200/   ...
// Each is saved atomically, so the newest complete one is always loadable: a save that dies leaves
// debris (step-N.new) beside complete checkpoints, which resuming ignores and the next save of step
// N replaces. Once a new checkpoint is complete, the older ones beyond the newest `keep` are removed.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dmuon {

// DIR/step-<step, 8 digits or more>.
std::string checkpoint_for_step(const std::string& dir, int64_t step);

// The checkpoint to resume from: `path` itself when it is a checkpoint (is_checkpoint), else the
// complete step-N checkpoint in it with the largest N. Throws dmuon::Error naming `path` when there
// is none.
std::string newest_checkpoint(const std::string& path);

// The step of the newest complete checkpoint in DIR, if any.
std::optional<int64_t> newest_checkpoint_step(const std::string& dir);

// Before any work: throws the dmuon::Error saving into DIR would meet, touching nothing. DIR may be
// missing (the first save creates it) or hold step-N checkpoints (and the debris of their saves), each
// of which check_checkpoint_destination accepts; anything else in it (a file of someone's, a
// checkpoint of its own) is refused, since pruning removes step-N folders whole. One process's
// check; call it on rank 0.
void check_checkpoint_folder(const std::string& dir);

// Removes the complete step-N checkpoints of DIR beyond the newest `keep` (≥ 1), and the debris of
// saves of older steps. Touches nothing else in DIR.
void prune_checkpoints(const std::string& dir, int keep);

}  // namespace dmuon
