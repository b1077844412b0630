#include "from_rank0.hpp"

#include <cstdint>
#include <exception>
#include <span>

#include "dmuon/error.hpp"

namespace dmuon::detail {

std::string from_rank0(comm::Comm& comm, const std::function<std::string()>& produce, const std::string& what) {
  // Header [status, length]: status 0 and the payload follows, or status 1 and rank 0's error message
  // follows, so every rank learns the length of the second broadcast and why it fails.
  std::string bytes;
  std::exception_ptr failure;
  int64_t header[2] = {0, 0};
  if (comm.rank() == 0) {
    try {
      bytes = produce();
    } catch (const std::exception& e) {
      failure = std::current_exception();
      bytes = e.what();
      header[0] = 1;
    }
    header[1] = static_cast<int64_t>(bytes.size());
  }
  comm.broadcast<int64_t>(header, 0).wait();
  bytes.resize(static_cast<size_t>(header[1]));
  comm.broadcast<uint8_t>(std::span<uint8_t>(reinterpret_cast<uint8_t*>(bytes.data()), bytes.size()), 0).wait();
  if (header[0] == 0) return bytes;
  if (failure) std::rethrow_exception(failure);
  DMUON_FAIL("rank ", comm.rank(), ": rank 0 could not ", what, ": ", bytes);
}

}  // namespace dmuon::detail
