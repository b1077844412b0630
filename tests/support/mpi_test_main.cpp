// main() for the multi-rank tests: every rank runs every test; only rank 0 prints GoogleTest's
// report, and the process exits non-zero on every rank if any rank saw a failure.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

namespace {
// Prints a non-zero rank's failures, each tagged with the rank, and nothing else.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) {
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?",
                   r.line_number(), r.message());
    }
  }

 private:
  int rank_;
};
}  // namespace

int main(int argc, char** argv) {
  // The thread level production asks for (src/comm/mpi_comm.cpp), so the tests run what users run.
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  int failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any_failed;
}
