// Training data for the GPT example: byte-level text (vocabulary 256), a deterministic train/validation
// split, and batches drawn deterministically from (seed, step) so that the global batch, and so the
// training trajectory, does not depend on the number of ranks.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dmuon {

// The default corpus: the English fortunes of Debian's `fortunes` package. Only the plain text files
// directly in the folder are read (sorted by name); the `.dat` indexes, the `.u8` symlinks (duplicates of
// the plain files) and any subfolder are skipped. That excludes the offensive fortunes, which Debian ships
// separately (package fortunes-off, in the subfolder `off/`).
std::string default_corpus_dir();  // /usr/share/games/fortunes

struct TextFile {
  std::string path;
  int64_t bytes = 0;
  int64_t train_bytes = 0;  // the file's first train_bytes bytes are training data, the rest validation
};

// Token streams: bytes as tokens. Each file is split at its last line start at or before 90% of its
// length (where none, at 90% exactly): its head goes to `train`, its tail (at least 10%) to `val`. Files are
// concatenated in name order. Every file is thus represented in both, and no byte is in both.
struct TextCorpus {
  std::vector<TextFile> files;
  std::vector<uint8_t> train;
  std::vector<uint8_t> val;
};

// Reads `path`: a text file, or a folder whose regular files (not symlinks, not subfolders) are read in
// name order. An empty path means default_corpus_dir(). Throws dmuon::Error naming the path when it is
// missing, holds no file, is empty, or a file looks binary (see looks_binary).
TextCorpus load_text_corpus(const std::string& path);

// True when the first 1024 bytes hold a NUL byte or more than 10% bytes that are neither printable
// ASCII, whitespace, nor part of a valid-looking UTF-8 sequence (bytes ≥ 0x80 count as text).
bool looks_binary(const std::string& bytes);

// Which part of a global batch a rank reads, and which micro-batch of that part.
struct BatchSlice {
  int rank = 0, world = 1;           // rank r of D reads sequences [r·B/D, (r+1)·B/D)
  int micro = 0, micro_batches = 1;  // micro-batch m of M reads the m-th of M equal pieces of that
};

// A batch of `rows` sequences: inputs (rows,T) and targets (rows,T), targets = inputs shifted by one.
struct TokenBatch {
  int64_t rows = 0, T = 0;
  std::vector<int32_t> inputs, targets;
};

// Start offsets in `stream_size` tokens of the B sequences (T+1 tokens each) of global batch `step`:
// each is a pure function of (seed, step, index), uniform over [0, stream_size − T − 1].
std::vector<int64_t> global_batch_starts(int64_t stream_size, int64_t B, int64_t T, uint64_t seed, int64_t step);

// The slice of global batch `step` (B sequences of T+1 tokens from `stream`) that `slice` names.
// Throws dmuon::Error when B is not divisible by world·micro_batches, or the stream is shorter than T+1.
TokenBatch sample_batch(const std::vector<uint8_t>& stream, int64_t B, int64_t T, uint64_t seed, int64_t step,
                        const BatchSlice& slice = {});

}  // namespace dmuon
