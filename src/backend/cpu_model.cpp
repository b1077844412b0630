// linalg::cpu_model, in every build (the GPU-only one included: the tuning cache's key names the CPU).
#include <fstream>
#include <string>

#include "dmuon/linalg.hpp"

namespace dmuon::linalg {

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "unknown CPU";
}

}  // namespace dmuon::linalg
