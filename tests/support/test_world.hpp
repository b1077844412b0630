// The world communicator of a multi-rank optimizer test, made once, with one BLAS thread per rank (the
// ranks share the cores). Header-only.
#pragma once

#include <memory>

#include "dmuon/comm.hpp"
#include "dmuon/linalg.hpp"

namespace dmuon::test {

inline std::shared_ptr<comm::Comm> world() {
  static std::shared_ptr<comm::Comm> w = [] {
    linalg::set_threads(1);
    return comm::world();
  }();
  return w;
}

}  // namespace dmuon::test
