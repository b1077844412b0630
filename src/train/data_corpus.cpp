// Loading text for the GPT example: files or a folder of files, checked to be text, split train/validation.
#include <algorithm>
#include <filesystem>
#include <set>

#include "dmuon/atomic_file.hpp"
#include "dmuon/data.hpp"
#include "dmuon/error.hpp"

namespace dmuon {

namespace fs = std::filesystem;

std::string default_corpus_dir() { return "/usr/share/games/fortunes"; }

namespace {

// Length of the UTF-8 sequence starting at s[i] when it is well-formed (lead byte, continuation
// bytes), else 0. A sequence cut off by the end of the sample counts as well-formed.
size_t utf8_sequence_length(const std::string& s, size_t i) {
  const auto lead = static_cast<unsigned char>(s[i]);
  size_t n = lead >= 0xf0 && lead <= 0xf4 ? 4 : lead >= 0xe0 ? 3 : lead >= 0xc2 && lead <= 0xdf ? 2 : 0;
  if (n == 0) return 0;
  for (size_t k = 1; k < n && i + k < s.size(); k++) {
    if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return 0;
  }
  return n;
}

// A folder's files in name order: regular files only (symlinks, such as fortunes' `.u8` aliases, and
// subfolders, such as `off/`, are skipped), and not `NAME.dat` beside `NAME` (a strfile index).
std::vector<std::string> folder_files(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_symlink() || !entry.is_regular_file()) continue;
    std::string name = entry.path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    names.insert(name);
  }
  std::vector<std::string> files;
  for (const std::string& name : names) {
    const bool index = name.size() > 4 && name.ends_with(".dat") && names.count(name.substr(0, name.size() - 4));
    if (!index) files.push_back((dir / name).string());
  }
  return files;
}

// The last line start after the first byte and at or before 90% of the text, so that validation starts on
// a line boundary and gets at least 10% of every file; 90% exactly when no line ends before it.
int64_t train_split_point(const std::string& text) {
  const size_t nominal = text.size() - text.size() / 10;
  const size_t newline = nominal == 0 ? std::string::npos : text.rfind('\n', nominal - 1);
  return static_cast<int64_t>(newline == std::string::npos ? nominal : newline + 1);
}

}  // namespace

bool looks_binary(const std::string& bytes) {
  const std::string sample = bytes.substr(0, 1024);
  size_t non_text = 0;
  for (size_t i = 0; i < sample.size();) {
    const auto c = static_cast<unsigned char>(sample[i]);
    if (c == 0) return true;
    if (c >= 0x80) {
      const size_t n = utf8_sequence_length(sample, i);
      if (n == 0) {
        non_text++;
        i++;
      } else {
        i += n;
      }
      continue;
    }
    const bool whitespace = c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
    if ((c < 0x20 && !whitespace) || c == 0x7f) non_text++;
    i++;
  }
  return non_text * 10 > sample.size();
}

TextCorpus load_text_corpus(const std::string& path_in) {
  const std::string path = path_in.empty() ? default_corpus_dir() : path_in;
  std::error_code ec;
  DMUON_CHECK(fs::exists(path, ec), "data source ", path, " does not exist");
  std::vector<std::string> paths;
  if (fs::is_directory(path, ec)) {
    paths = folder_files(path);
    DMUON_CHECK(!paths.empty(), "data folder ", path, " holds no regular file");
  } else {
    paths.push_back(path);
  }
  TextCorpus corpus;
  for (const std::string& file : paths) {
    const std::string text = read_file(file);
    DMUON_CHECK(!text.empty(), "data file ", file, " is empty");
    DMUON_CHECK(!looks_binary(text), "data file ", file,
                " looks binary (a NUL byte or over 10% non-text bytes in its first KB); give text files");
    TextFile f{file, static_cast<int64_t>(text.size()), train_split_point(text)};
    corpus.train.insert(corpus.train.end(), text.begin(), text.begin() + f.train_bytes);
    corpus.val.insert(corpus.val.end(), text.begin() + f.train_bytes, text.end());
    corpus.files.push_back(std::move(f));
  }
  return corpus;
}

}  // namespace dmuon
