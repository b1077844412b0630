// The world communicator of a multi-rank optimizer test, made once, with one BLAS thread per rank (the
// ranks share the cores), and a folder every rank sees. Header-only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dmuon/comm.hpp"
#include "dmuon/linalg.hpp"
#include "test_data.hpp"

namespace dmuon::test {

inline std::shared_ptr<comm::Comm> world() {
  static std::shared_ptr<comm::Comm> w = [] {
    linalg::set_threads(1);
    return comm::world();
  }();
  return w;
}

// A folder every rank sees: rank 0's `mine`, its path broadcast.
inline std::string shared_folder(TempDir& mine) {
  std::vector<uint8_t> path(4096, 0);
  if (world()->rank() == 0) std::copy(mine.path().begin(), mine.path().end(), path.begin());
  world()->broadcast<uint8_t>(path, 0).wait();
  return std::string(reinterpret_cast<const char*>(path.data()));
}

}  // namespace dmuon::test
