// Byte-level text data for the GPT example: corpus loading, train/validation split, batches.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "dmuon/data.hpp"
#include "dmuon/error.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

namespace fs = std::filesystem;

void write(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

std::string as_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

// Expects load_text_corpus(path) to throw an Error whose message names `path` and contains `what`.
void expect_load_error(const std::string& path, const std::string& what) {
  try {
    load_text_corpus(path);
    ADD_FAILURE() << "no error for " << path;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  }
}

TEST(TextData, DefaultCorpusIsThePlainFortuneFiles) {
  const TextCorpus c = load_text_corpus("");
  ASSERT_GE(c.files.size(), 30u);
  int64_t total = 0;
  for (const TextFile& f : c.files) {
    EXPECT_FALSE(f.path.ends_with(".dat")) << f.path;
    EXPECT_FALSE(f.path.ends_with(".u8")) << f.path;
    EXPECT_FALSE(fs::is_symlink(f.path)) << f.path;
    EXPECT_EQ(fs::path(f.path).parent_path(), fs::path(default_corpus_dir())) << f.path;
    total += f.bytes;
  }
  EXPECT_TRUE(std::is_sorted(c.files.begin(), c.files.end(),
                             [](const TextFile& a, const TextFile& b) { return a.path < b.path; }));
  EXPECT_GT(total, 2'000'000);  // about 2.6 MB of English text
  EXPECT_EQ(static_cast<int64_t>(c.train.size() + c.val.size()), total);
  EXPECT_NEAR(static_cast<double>(c.val.size()) / total, 0.1, 0.01);
}

TEST(TextData, FolderFilesInNameOrderSkippingLinksSubfoldersAndIndexes) {
  test::TempDir dir;
  write(dir.file("b"), "bravo\n");
  write(dir.file("a"), "alpha\n");
  write(dir.file("a.dat"), std::string("\0\0\0\2", 4));  // strfile index of "a"
  write(dir.file("notes.dat"), "plain text called .dat, no sibling\n");
  fs::create_symlink(dir.file("a"), dir.file("a.u8"));
  fs::create_directory(dir.file("off"));
  write(dir.file("off/c"), "charlie\n");
  const TextCorpus c = load_text_corpus(dir.path());
  ASSERT_EQ(c.files.size(), 3u);
  EXPECT_EQ(c.files[0].path, dir.file("a"));
  EXPECT_EQ(c.files[1].path, dir.file("b"));
  EXPECT_EQ(c.files[2].path, dir.file("notes.dat"));
}

// Each file's head (up to its last line start at or before 90%) is training data, its tail validation.
TEST(TextData, SplitIsPerFileAtALineStartAndDisjoint) {
  test::TempDir dir;
  std::string one, two;
  for (int i = 0; i < 20; i++) one += "line " + std::to_string(i) + " of file one\n";
  for (int i = 0; i < 9; i++) two += "two" + std::to_string(i) + "\n";
  write(dir.file("1"), one);
  write(dir.file("2"), two);
  const TextCorpus c = load_text_corpus(dir.path());
  ASSERT_EQ(c.files.size(), 2u);
  std::string train_expected, val_expected;
  for (const auto& [f, text] : {std::pair{c.files[0], one}, std::pair{c.files[1], two}}) {
    EXPECT_EQ(f.bytes, static_cast<int64_t>(text.size()));
    EXPECT_LE(f.train_bytes, f.bytes - f.bytes / 10);
    EXPECT_GT(f.train_bytes, f.bytes / 2);
    EXPECT_EQ(text[f.train_bytes - 1], '\n') << "validation starts mid-line in " << f.path;
    train_expected += text.substr(0, f.train_bytes);
    val_expected += text.substr(f.train_bytes);
  }
  EXPECT_EQ(as_string(c.train), train_expected);
  EXPECT_EQ(as_string(c.val), val_expected);
  // Batches of a split draw only from it: every sequence is a substring of that split.
  const TokenBatch b = sample_batch(c.val, 4, 5, 1, 0);
  for (int64_t r = 0; r < b.rows; r++) {
    std::string seq;
    for (int64_t t = 0; t < b.T; t++) seq += static_cast<char>(b.inputs[r * b.T + t]);
    EXPECT_NE(val_expected.find(seq), std::string::npos);
  }
}

TEST(TextData, BadSourcesAreErrorsNamingThePath) {
  test::TempDir dir;
  expect_load_error(dir.file("missing.txt"), "does not exist");
  write(dir.file("empty.txt"), "");
  expect_load_error(dir.file("empty.txt"), "is empty");
  fs::create_directory(dir.file("none"));
  expect_load_error(dir.file("none"), "no regular file");
  write(dir.file("nul.bin"), std::string("text then a NUL\0 byte", 21));
  expect_load_error(dir.file("nul.bin"), "binary");
  std::string controls;
  for (int i = 0; i < 200; i++) controls += (i % 5 == 0) ? '\x01' : 'x';  // 20% control bytes
  write(dir.file("controls.bin"), controls);
  expect_load_error(dir.file("controls.bin"), "binary");
  // In a folder, the offending file is named.
  fs::create_directory(dir.file("mixed"));
  write(dir.file("mixed/a.txt"), "fine\n");
  write(dir.file("mixed/b.bin"), std::string("\x89PNG\r\n\x1a\n\0\0", 10));
  expect_load_error(dir.file("mixed/b.bin"), "binary");
}

TEST(TextData, LooksBinary) {
  EXPECT_FALSE(looks_binary("Plain English.\n\tIndented, with a form feed \f.\n"));
  EXPECT_FALSE(looks_binary("UTF-8: na\xc3\xafve caf\xc3\xa9, \xe2\x80\x94 em dash, \xf0\x9f\x98\x80.\n"));
  std::string high;
  for (int i = 0; i < 300; i++) high += static_cast<char>(0x80 + i % 64);  // continuation bytes, no leads
  EXPECT_TRUE(looks_binary(high));
  EXPECT_TRUE(looks_binary(std::string("ab\0cd", 5)));
  // Only the first KB is sampled.
  EXPECT_FALSE(looks_binary(std::string(2000, 'a') + std::string("\0", 1)));
}

std::vector<uint8_t> counting_stream(int64_t n) {
  std::vector<uint8_t> s(n);
  for (int64_t i = 0; i < n; i++) s[i] = static_cast<uint8_t>(i * 7 + i / 256);
  return s;
}

TEST(TextData, BatchesAreAPureFunctionOfSeedAndStep) {
  const auto stream = counting_stream(5000);
  const TokenBatch a = sample_batch(stream, 8, 16, 3, 10), b = sample_batch(stream, 8, 16, 3, 10);
  EXPECT_EQ(a.inputs, b.inputs);
  EXPECT_EQ(a.targets, b.targets);
  EXPECT_NE(a.inputs, sample_batch(stream, 8, 16, 3, 11).inputs);
  EXPECT_NE(a.inputs, sample_batch(stream, 8, 16, 4, 10).inputs);
  // Targets are the inputs shifted by one token, within the stream.
  const auto starts = global_batch_starts(5000, 8, 16, 3, 10);
  for (int64_t r = 0; r < 8; r++) {
    ASSERT_LE(starts[r] + 16 + 1, 5000);
    for (int64_t t = 0; t < 16; t++) {
      EXPECT_EQ(a.inputs[r * 16 + t], stream[starts[r] + t]);
      EXPECT_EQ(a.targets[r * 16 + t], stream[starts[r] + t + 1]);
    }
  }
  // A stream of exactly T+1 tokens has one possible sequence.
  EXPECT_EQ(global_batch_starts(17, 3, 16, 1, 0), (std::vector<int64_t>{0, 0, 0}));
}

// Concatenating the ranks' (and micro-batches') parts gives the single-rank batch, for D = 1, 2, 4.
TEST(TextData, GlobalBatchDoesNotDependOnRanksOrMicroBatches) {
  const auto stream = counting_stream(3000);
  const int64_t B = 8, T = 12;
  for (int64_t step : {0, 1, 57}) {
    const TokenBatch whole = sample_batch(stream, B, T, 9, step);
    ASSERT_EQ(whole.rows, B);
    for (int world : {1, 2, 4}) {
      for (int micro_batches : {1, 2}) {
        std::vector<int32_t> inputs, targets;
        for (int rank = 0; rank < world; rank++) {
          for (int m = 0; m < micro_batches; m++) {
            const TokenBatch part = sample_batch(stream, B, T, 9, step, {rank, world, m, micro_batches});
            EXPECT_EQ(part.rows, B / world / micro_batches);
            inputs.insert(inputs.end(), part.inputs.begin(), part.inputs.end());
            targets.insert(targets.end(), part.targets.begin(), part.targets.end());
          }
        }
        EXPECT_EQ(inputs, whole.inputs) << "D=" << world << " M=" << micro_batches;
        EXPECT_EQ(targets, whole.targets) << "D=" << world << " M=" << micro_batches;
      }
    }
  }
}

TEST(TextData, IndivisibleBatchesAndShortStreamsAreErrors) {
  const auto stream = counting_stream(100);
  EXPECT_THROW(sample_batch(stream, 6, 8, 1, 0, {0, 4, 0, 1}), Error);  // 6 over 4 ranks
  EXPECT_THROW(sample_batch(stream, 8, 8, 1, 0, {0, 4, 0, 3}), Error);  // 2 per rank over 3 micro-batches
  EXPECT_THROW(sample_batch(stream, 8, 8, 1, 0, {4, 4, 0, 1}), Error);  // rank outside the world
  EXPECT_THROW(sample_batch(stream, 8, 100, 1, 0), Error);              // stream shorter than T+1
  try {
    sample_batch(stream, 6, 8, 1, 0, {0, 4, 0, 1});
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not divisible by the number of ranks 4"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dmuon
