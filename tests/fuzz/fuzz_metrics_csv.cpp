// Fuzz target: metrics CSV files as `dmuon compare` reads them (read_metrics_csv, summarize_run).
#include "dmuon/metrics_csv.hpp"
#include "fuzz_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dmuon::fuzz::write_scratch("metrics.csv", dmuon::fuzz::as_text(data, size));
  dmuon::fuzz::expect_only_dmuon_errors([&] { dmuon::summarize_run(dmuon::read_metrics_csv(path)); });
  return 0;
}
