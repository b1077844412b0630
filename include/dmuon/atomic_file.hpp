// Writing files so that a reader sees the old file or the complete new one, never a part:
// write to a temporary file beside the target, fsync it, rename it over the target, fsync the folder.
#pragma once

#include <string>
#include <string_view>

namespace dmuon {

void write_file_atomically(const std::string& path, std::string_view bytes);

// Renames `from` to `to` (a file, or a folder onto a missing or empty one) and fsyncs the folder
// holding `to`, so the rename survives a crash. Throws dmuon::Error naming both.
void rename_durably(const std::string& from, const std::string& to);

// Why the file (or, with `folder`, the folder) `path` could not be written, created or replaced, with
// any missing folders above it: "" when it can be. Checked before work starts, so a run does not end
// in a failed write: the nearest existing folder above `path` must take a new file (a probe file is
// created and removed there; nothing else is written), and an existing `path` must be a writable
// regular file (with `folder`: a folder).
std::string why_cannot_write(const std::string& path, bool folder = false);

// Reads a whole file; throws dmuon::Error naming the file when it cannot be opened or read.
std::string read_file(const std::string& path);

}  // namespace dmuon
