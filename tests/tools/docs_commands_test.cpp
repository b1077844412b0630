// The docs and the tool cannot drift apart: every dmuon command line quoted in README.md and docs/*.md
// (inline `code` or a shell block) names only options its subcommand has, and every one a 2-core
// machine can run in seconds is run, with the tiny sizes README.md announces substituted (kTiny below):
// one layer, one step or repeat, small shapes and batches, two devices and two ranks at most; every
// output goes to a temporary folder. A quoted name alone (`dmuon tune`) is a reference, not a command
// line; a template (`--model M`, `[--batch K]`, `...`) has its options checked but is not run.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "dmuon/atomic_file.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

namespace fs = std::filesystem;

const fs::path kRoot = fs::path(DMUON_TEST_DATA_DIR).parent_path().parent_path();

struct Quoted {
  std::string file;
  std::string text;  // the command line as the doc writes it
};

std::vector<std::string> words(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

std::string join(const std::vector<std::string>& w, size_t from = 0) {
  std::string out;
  for (size_t i = from; i < w.size(); ++i) out += (out.empty() ? "" : " ") + w[i];
  return out;
}

// Where the dmuon words start: at `dmuon` or `build/dmuon`, alone or as the program `mpirun` starts
// (the first word after mpirun's options, so `mpirun ... python3 x.py --optim dmuon` is not ours); npos if none.
size_t dmuon_at(const std::vector<std::string>& w) {
  const auto ours = [&](size_t i) { return w[i] == "dmuon" || w[i] == "build/dmuon"; };
  if (w.empty() || w[0] != "mpirun") return !w.empty() && ours(0) ? 0 : std::string::npos;
  const std::set<std::string> takes_value = {"-np", "-n", "-x", "-H", "--host", "--bind-to", "--map-by"};
  for (size_t i = 1; i < w.size(); ++i) {
    if (w[i][0] == '-') {
      if (takes_value.count(w[i])) ++i;
      continue;
    }
    return ours(i) ? i : std::string::npos;
  }
  return std::string::npos;
}

// Every command line in the file: inline code spans, and lines of ```sh blocks (joined at '\').
// Read line by line: std::regex over a whole page recurses once per character and overflows the stack.
std::vector<Quoted> quoted_in(const fs::path& file) {
  std::istringstream text(read_file(file.string()));
  std::vector<std::string> candidates;
  std::string prose, joined, language;
  bool in_block = false;
  for (std::string line; std::getline(text, line);) {
    const size_t indent = line.find_first_not_of(' ');
    if (indent != std::string::npos && line.compare(indent, 3, "```") == 0) {
      in_block = !in_block;
      language = in_block ? line.substr(indent + 3) : "";
      joined.clear();
      continue;
    }
    if (!in_block) {
      prose += line + "\n";
    } else if (language.empty() || language == "sh" || language == "bash") {
      if (!line.empty() && line.back() == '\\') {
        joined += line.substr(0, line.size() - 1) + " ";
        continue;
      }
      candidates.push_back(joined + line);
      joined.clear();
    }
  }
  const std::regex span("`([^`\n]+)`");
  for (std::sregex_iterator it(prose.begin(), prose.end(), span), end; it != end; ++it) candidates.push_back((*it)[1]);
  std::vector<Quoted> out;
  for (const std::string& c : candidates) {
    const auto w = words(c);
    const size_t at = dmuon_at(w);
    if (w.empty() || w[0] == "#" || at == std::string::npos) continue;
    if (at + 1 < w.size() && w[at + 1].back() == ':') continue;  // the tool's output ("dmuon train: stopped ...")
    bool has_option = false;
    for (size_t i = at + 1; i < w.size(); ++i) has_option = has_option || w[i].rfind("-", 0) == 0;
    if (has_option) out.push_back({fs::relative(file, kRoot).string(), join(w)});
  }
  return out;
}

// The subcommand words after dmuon ("bench ns") and the rest.
std::pair<std::string, std::vector<std::string>> split(const std::vector<std::string>& w, size_t at) {
  std::string path;
  size_t i = at + 1;
  for (; i < w.size() && w[i].rfind("-", 0) != 0; ++i) path += (path.empty() ? "" : " ") + w[i];
  return {path, std::vector<std::string>(w.begin() + static_cast<long>(i), w.end())};
}

// A template: placeholders in capitals (M, N, DIR, LABEL=CSV, G.npy), "...", or [optional] parts.
bool is_template(const std::string& text) {
  return std::regex_search(text, std::regex(R"((^|[ =,])([A-Z]+|[A-Z]\.npy|LABEL=CSV)( |$)|\.\.\.|\[|\|)"));
}

// Commands quoted but not run, by how they start after `dmuon`, with the reason (their options are still
// checked).
const std::map<std::string, std::string> kNotRun = {
    {"bench e2e --config large", "tunes the large GPT's shapes first: about a minute on 2 cores"},
    {"bench ablation", "every part of DMuon removed in turn: minutes even at one layer"},
    {"bench calibrate", "measures every rate of the simulator's profile: minutes"},
    {"bench ns --device cuda", "needs a CUDA device (scripts/gpu-check.sh runs it on one)"},
    {"bench optimizer", "tunes Qwen2.5-0.5B's 896x4864 shapes: tens of seconds even at one layer and one round"},
    {"tune", "tunes Qwen2.5-0.5B's 896x4864 shapes: tens of seconds even at one layer and one round"},
};

// The tiny sizes: option -> value ("" removes the option and its value).
const std::map<std::string, std::string> kTiny = {
    {"--steps", "1"}, {"--repeats", "1"}, {"--rounds", "1"}, {"--layers", "1"}, {"--warmup", "0"},
    {"--batch", "4"}, {"--shapes", "64x128"}, {"--devices", "8,16"}, {"--time-limit", "0.2"},
    {"--split-heads", "2"}, {"--split-dims", "1"},  // one per --shapes entry
};

// The command as the test runs it: the built tool, at most two ranks, tiny sizes, outputs in `tmp`.
std::string runnable(const std::vector<std::string>& w, size_t at, const std::string& tmp) {
  const auto [path, rest] = split(w, at);
  std::string cmd = "cd " + kRoot.string() + " && timeout 120 ";
  if (at > 0) {
    int np = 1;
    for (size_t i = 0; i + 1 < at; ++i)
      if (w[i] == "-np") np = std::min(2, std::stoi(w[i + 1]));
    cmd += std::string(DMUON_MPIRUN) + " -np " + std::to_string(np) + " ";
  }
  cmd += std::string(DMUON_CLI_PATH) + " " + path;
  std::set<std::string> given;
  for (size_t i = 0; i < rest.size(); ++i) {
    const std::string& opt = rest[i];
    given.insert(opt);
    const bool has_value = i + 1 < rest.size() && rest[i + 1].rfind("--", 0) != 0;
    std::string value = has_value ? rest[i + 1] : "";
    if (has_value) ++i;
    if (kTiny.count(opt) && !(path == "simulate" && opt == "--batch")) value = kTiny.at(opt);
    // Outputs go to the temporary folder; inputs (profiles, docs/bench) are read where they are.
    if (opt == "--out" || opt == "--plot" || opt == "--tune-cache" || opt == "--save" || opt == "--csv")
      value = tmp + "/" + fs::path(value).filename().string();
    cmd += " " + opt + (has_value ? " " + value : "");
  }
  // Sizes the doc leaves at their defaults.
  auto add = [&](const std::string& opt, const std::string& value) {
    if (!given.count(opt)) cmd += " " + opt + " " + value;
  };
  if (given.count("--model")) add("--layers", "1");
  if (path == "bench ns") add("--shapes", "64x128"), add("--repeats", "1");
  if (path == "bench gpt") add("--repeats", "1"), add("--batch", "4");
  if (path == "simulate" && !given.count("--mesh")) add("--devices", given.count("--gpt") ? "1,2" : "8,16");
  if (path == "bench e2e") add("--steps", "1"), add("--batch", "4"), add("--warmup", "0");
  if (path == "train") add("--steps", "1"), add("--layers", "1"), add("--batch", "4");
  if (path == "plan") add("--time-limit", "0.2");
  if (path == "train" || path == "bench e2e" || path == "plan") add("--tune-cache", tmp + "/tune.json");
  return cmd;
}

std::vector<Quoted> all_quoted() {
  std::vector<fs::path> files = {kRoot / "README.md"};
  for (const auto& e : fs::directory_iterator(kRoot / "docs"))
    if (e.path().extension() == ".md") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::vector<Quoted> out;
  for (const auto& f : files)
    for (auto& q : quoted_in(f)) out.push_back(std::move(q));
  return out;
}

// The options `dmuon <path> --help` lists.
std::set<std::string> options_of(const std::string& path) {
  static std::map<std::string, std::set<std::string>> cache;
  auto it = cache.find(path);
  if (it != cache.end()) return it->second;
  const auto help = test::run_command(std::string(DMUON_CLI_PATH) + " " + path + " --help");
  std::set<std::string> out;
  const std::regex option(R"(--[a-z][a-z0-9-]*)");
  for (std::sregex_iterator m(help.output.begin(), help.output.end(), option), end; m != end; ++m)
    out.insert(m->str());
  return cache[path] = out;
}

TEST(DocsCommands, FindsTheCommandLinesOfEveryPage) {
  const auto quoted = all_quoted();
  std::set<std::string> files;
  for (const auto& q : quoted) files.insert(q.file);
  EXPECT_GE(quoted.size(), 30u);
  for (const char* f : {"README.md", "docs/BENCHMARKS.md", "docs/gpt-example.md", "docs/ns.md", "docs/simulator.md"})
    EXPECT_TRUE(files.count(f)) << f;
}

TEST(DocsCommands, EveryQuotedOptionExists) {
  for (const auto& q : all_quoted()) {
    const auto w = words(q.text);
    const auto [path, rest] = split(w, dmuon_at(w));
    const std::set<std::string> known = options_of(path);
    ASSERT_FALSE(known.empty()) << q.file << ": `" << q.text << "`: no such subcommand '" << path << "'";
    for (const std::string& word : rest) {
      std::smatch m;
      const std::string bare = word.substr(word.find_first_not_of("[`"));
      if (!std::regex_search(bare, m, std::regex(R"(^--[a-z][a-z0-9-]*)"))) continue;
      EXPECT_TRUE(known.count(m.str())) << q.file << ": `" << q.text << "`: dmuon " << path << " has no " << m.str();
    }
  }
}

TEST(DocsCommands, EveryQuotedCommandThatRunsInSecondsRuns) {
  test::TempDir tmp;
  std::set<std::string> ran;
  for (const auto& q : all_quoted()) {
    if (is_template(q.text)) continue;
    const auto w = words(q.text);
    const size_t at = dmuon_at(w);
    const auto [path, rest] = split(w, at);
    const std::string after_dmuon = path + " " + join(rest);
    bool not_run = false;
    for (const auto& [start, why] : kNotRun) not_run = not_run || after_dmuon.rfind(start, 0) == 0;
    if (not_run) continue;
    const std::string cmd = runnable(w, at, tmp.path());
    if (!ran.insert(cmd).second) continue;
    const auto r = test::run_command(cmd);
    EXPECT_EQ(r.exit_code, 0) << q.file << ": `" << q.text << "`\nran: " << cmd << "\n" << r.output;
  }
  EXPECT_GE(ran.size(), 15u);
}

}  // namespace
}  // namespace dmuon
