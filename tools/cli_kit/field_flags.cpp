// Field names to command-line flags (field_flags.hpp).
#include "cli_kit/field_flags.hpp"

#include <algorithm>
#include <regex>

namespace dmuon::cli {

std::string train_flag(std::string_view field) {
  std::string name(field);
  if (name.rfind("model.", 0) == 0) name = name.substr(6);  // GptConfig's fields: --layers, --width, ...
  if (name == "save_dir") name = "save";
  std::replace(name.begin(), name.end(), '_', '-');
  return "--" + name;
}

std::string with_flags(const std::string& text) {
  // "TrainOptions.model.width" and "GptConfig.width" are both --width.
  static const std::regex field(R"((TrainOptions|GptConfig)\.([a-z_]+(\.[a-z_]+)?))");
  std::string out;
  auto last = text.cbegin();
  for (std::sregex_iterator it(text.begin(), text.end(), field), end; it != end; ++it) {
    out.append(last, text.cbegin() + it->position());
    out += train_flag((*it)[2].str());
    last = text.cbegin() + it->position() + it->length();
  }
  out.append(last, text.cend());
  static const std::regex kind(R"(OptimizerStackOptions\.kind)"), cache(R"(TuneSessionOptions\.cache_path)");
  return std::regex_replace(std::regex_replace(out, kind, "--optim"), cache, "--tune-cache");
}

}  // namespace dmuon::cli
