// One rank's decision or failure reaching every rank (include/dmuon/rank_agreement.hpp).
#include "dmuon/rank_agreement.hpp"

#include <cstdint>
#include <span>

#include "dmuon/comm.hpp"
#include "dmuon/error.hpp"

namespace dmuon::comm {

std::exception_ptr capture_failure(const std::function<void()>& action, const std::string& doing) {
  try {
    action();
    return nullptr;
  } catch (const Error&) {
    return std::current_exception();
  } catch (const std::exception& e) {
    return std::make_exception_ptr(Error(doing + ": " + e.what()));
  } catch (...) {
    return std::current_exception();
  }
}

void throw_if_any_failed(const std::exception_ptr& mine, double failures, int rank, const std::string& elsewhere) {
  if (mine) std::rethrow_exception(mine);
  if (failures != 0) throw PeerFailed(elsewhere + "; this is rank " + std::to_string(rank));
}

void throw_if_any_failed(Comm& comm, const std::exception_ptr& mine, const std::string& elsewhere) {
  double failures[1] = {mine ? 1.0 : 0.0};
  comm.all_reduce<double>(failures, ReduceOp::sum).wait();
  throw_if_any_failed(mine, failures[0], comm.rank(), elsewhere);
}

std::string from_rank0(Comm& comm, const std::function<std::string()>& produce, const std::string& what) {
  // Header [status, length]: status 0 and the payload follows, or status 1 and rank 0's error message
  // follows, so every rank learns the length of the second broadcast and why it fails.
  std::string bytes;
  std::exception_ptr failure;
  int64_t header[2] = {0, 0};
  if (comm.rank() == 0) {
    failure = capture_failure([&] { bytes = produce(); }, what);
    if (failure) {
      try {
        std::rethrow_exception(failure);
      } catch (const std::exception& e) {
        bytes = e.what();
      } catch (...) {
        bytes = "an exception that is not a std::exception";
      }
      header[0] = 1;
    }
    header[1] = static_cast<int64_t>(bytes.size());
  }
  comm.broadcast<int64_t>(header, 0).wait();
  bytes.resize(static_cast<size_t>(header[1]));
  comm.broadcast<uint8_t>(std::span<uint8_t>(reinterpret_cast<uint8_t*>(bytes.data()), bytes.size()), 0).wait();
  throw_if_any_failed(failure, static_cast<double>(header[0]), comm.rank(), "rank 0 could not " + what + ": " + bytes);
  return bytes;
}

}  // namespace dmuon::comm
