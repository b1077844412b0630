// `dmuon bench comm`: bus bandwidth of each collective, nccl-tests style, under mpirun.
//   size   = bytes of the collective's full buffer (all-gather: recv; reduce-scatter: send;
//            all-reduce, broadcast: the buffer)
//   algbw  = size / time;  busbw = algbw × factor: all-gather(v) and reduce-scatter(v) (n−1)/n,
//            all-reduce 2(n−1)/n, broadcast 1
//   time   = mean over the timed iterations on each rank, then the max over ranks
//   wrong  = elements that differ from the value known by formula, summed over ranks (must be 0)
// The uneven rows (DESIGN 3.1) give rank 0 half of the buffer, spread the rest over the other
// ranks and leave the last rank empty (at 3+ ranks), once with each VAlgorithm.
// The overlap rows post an all-gather of the largest size, run compute about twice as long, then
// wait: once without touching MPI during compute, once polling test() between compute chunks.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_kit/cli.hpp"
#include "dmuon/comm.hpp"

namespace comm_bench {

using dmuon::comm::Comm;
using dmuon::ReduceOp;
using dmuon::comm::VAlgorithm;
using dmuon::comm::Work;
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

// Larger buffers are a typo: each rank allocates a few of them.
constexpr int64_t kMaxBytes = int64_t(64) << 30;

int64_t parse_bytes(const std::string& text) {
  std::size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    DMUON_FAIL("--bytes: '", text, "' is not a size (e.g. 4K, 1M, 64M)");
  }
  std::string unit = text.substr(used);
  double scale = unit.empty() || unit == "B" ? 1
                 : unit == "K"               ? 1 << 10
                 : unit == "M"               ? 1 << 20
                 : unit == "G"               ? 1 << 30
                                             : 0;
  DMUON_CHECK(scale > 0 && v > 0, "--bytes: '", text, "' is not a size (e.g. 4K, 1M, 64M)");
  // Checked in double before the cast: converting a value past int64's range is undefined.
  const double bytes = v * scale;
  DMUON_CHECK(bytes >= 4, "--bytes: '", text, "' is less than one float32 (4 bytes)");
  DMUON_CHECK(bytes <= double(kMaxBytes), "--bytes: '", text, "' is larger than 64G, the largest size");
  return static_cast<int64_t>(bytes);
}

// Small integers: sums over up to 2^16 ranks stay exact in float32.
float value(int64_t rank, int64_t i) { return static_cast<float>((rank * 7 + i) % 251); }

struct Row {
  std::string collective, algorithm;
  int64_t bytes = 0;
  double seconds = 0, algbw = 0, busbw = 0;
  int64_t wrong = 0;
};

class Bench {
 public:
  Bench(std::shared_ptr<Comm> world, int iters)
      : c_(std::move(world)), n_(c_->size()), me_(c_->rank()), iters_(iters) {}

  double max_over_ranks(double x) {
    c_->all_reduce<double>(std::span<double>(&x, 1), ReduceOp::max).wait();
    return x;
  }
  int64_t sum_over_ranks(int64_t x) {
    c_->all_reduce<int64_t>(std::span<int64_t>(&x, 1), ReduceOp::sum).wait();
    return x;
  }
  void barrier() { sum_over_ranks(0); }

  // Runs `start` once untimed, then iters times; returns the row with time, bandwidths, errors.
  template <typename Start, typename Check>
  Row measure(std::string collective, std::string algorithm, int64_t bytes, double factor, Start start, Check check) {
    start().wait();
    barrier();
    const int iters = std::clamp<int>(static_cast<int>((256ll << 20) / std::max<int64_t>(bytes, 1)), 3, iters_);
    auto t0 = clock_type::now();
    for (int k = 0; k < iters; ++k) start().wait();
    Row row{std::move(collective), std::move(algorithm), bytes, max_over_ranks(seconds_since(t0) / iters)};
    row.algbw = bytes / row.seconds / 1e9;
    row.busbw = row.algbw * factor;
    row.wrong = sum_over_ranks(check());
    return row;
  }

  std::vector<Row> run_size(int64_t bytes) {
    std::vector<Row> rows;
    const int64_t block = std::max<int64_t>(1, bytes / 4 / n_);  // floats per rank
    const int64_t total = block * n_;
    const int64_t size = total * 4;
    const double ring = double(n_ - 1) / n_;

    std::vector<float> send(block), recv(total), full(total), out(block);
    for (int64_t i = 0; i < block; ++i) send[i] = value(me_, i);
    rows.push_back(measure(
        "all_gather", "mpi", size, ring, [&] { return c_->all_gather<float>(send, recv); },
        [&] {
          int64_t wrong = 0;
          for (int r = 0; r < n_; ++r)
            for (int64_t i = 0; i < block; ++i) wrong += recv[r * block + i] != value(r, i);
          return wrong;
        }));

    for (int64_t i = 0; i < total; ++i) full[i] = value(me_, i);
    auto sum_at = [&](int64_t i) {
      float s = 0;
      for (int r = 0; r < n_; ++r) s += value(r, i);
      return s;
    };
    rows.push_back(measure(
        "reduce_scatter", algorithm_name(), size, ring,
        [&] { return c_->reduce_scatter<float>(full, out, ReduceOp::sum); },
        [&] {
          int64_t wrong = 0;
          for (int64_t i = 0; i < block; ++i) wrong += out[i] != sum_at(me_ * block + i);
          return wrong;
        }));
    rows.push_back(measure(
        "all_reduce", "mpi", size, 2 * ring, [&] { return c_->all_reduce<float>(full, recv, ReduceOp::sum); },
        [&] {
          int64_t wrong = 0;
          for (int64_t i = 0; i < total; ++i) wrong += recv[i] != sum_at(i);
          return wrong;
        }));
    rows.push_back(measure(
        "broadcast", "mpi", size, 1,
        [&] {
          if (me_ == 0) std::copy(full.begin(), full.end(), recv.begin());
          return c_->broadcast<float>(recv, 0);
        },
        [&] {
          int64_t wrong = 0;
          for (int64_t i = 0; i < total; ++i) wrong += recv[i] != value(0, i);
          return wrong;
        }));
    return rows;
  }

  // Rank 0 half the buffer, the rest over ranks 1..n−2 (or 1 at two ranks), the last rank empty.
  std::vector<int64_t> uneven_counts(int64_t total) const {
    std::vector<int64_t> counts(n_, 0);
    if (n_ == 1) return {total};
    counts[0] = total / 2;
    const int others = n_ > 2 ? n_ - 2 : 1;
    for (int r = 1; r <= others; ++r) counts[r] = (total - counts[0]) / others;
    counts[others] += (total - counts[0]) % others;
    return counts;
  }

  std::vector<Row> run_uneven(int64_t bytes, std::shared_ptr<Comm> per_algo, const char* algo) {
    std::swap(c_, per_algo);
    const int64_t total = std::max<int64_t>(n_, bytes / 4);
    auto counts = uneven_counts(total);
    std::vector<int64_t> displ(n_ + 1, 0);
    for (int r = 0; r < n_; ++r) displ[r + 1] = displ[r] + counts[r];
    const double ring = double(n_ - 1) / n_;
    std::vector<float> mine(counts[me_]), recv(total), full(total), out(counts[me_]);
    for (int64_t i = 0; i < counts[me_]; ++i) mine[i] = value(me_, i);
    for (int64_t i = 0; i < total; ++i) full[i] = value(me_, i);
    std::vector<Row> rows;
    rows.push_back(measure(
        "all_gatherv uneven", algo, total * 4, ring, [&] { return c_->all_gatherv<float>(mine, recv, counts); },
        [&] {
          int64_t wrong = 0;
          for (int r = 0; r < n_; ++r)
            for (int64_t i = 0; i < counts[r]; ++i) wrong += recv[displ[r] + i] != value(r, i);
          return wrong;
        }));
    rows.push_back(measure(
        "reduce_scatterv uneven", algo, total * 4, ring,
        [&] { return c_->reduce_scatterv<float>(full, out, counts, ReduceOp::sum); },
        [&] {
          int64_t wrong = 0;
          for (int64_t i = 0; i < counts[me_]; ++i) {
            float s = 0;
            for (int r = 0; r < n_; ++r) s += value(r, displ[me_] + i);
            wrong += out[i] != s;
          }
          return wrong;
        }));
    std::swap(c_, per_algo);
    return rows;
  }

  // Exposed wait of an all-gather overlapped with compute, without and with polling.
  nlohmann::json overlap(int64_t bytes) {
    const int64_t block = std::max<int64_t>(1, bytes / 4 / n_);
    std::vector<float> send(block, 1.f), recv(block * n_);
    barrier();
    auto t0 = clock_type::now();
    c_->all_gather<float>(send, recv).wait();
    const double t_comm = max_over_ranks(seconds_since(t0));

    std::vector<float> x(1 << 18, 1.f), y(1 << 18, 0.f);  // 1 MiB each: a compute chunk stays in cache
    auto chunk = [&] {
      for (std::size_t i = 0; i < x.size(); ++i) y[i] = 0.999f * y[i] + x[i];
    };
    t0 = clock_type::now();
    for (int k = 0; k < 8; ++k) chunk();
    const double t_chunk = seconds_since(t0) / 8;
    const int chunks = static_cast<int>(std::clamp(2 * t_comm / t_chunk, 1.0, 100000.0));
    t0 = clock_type::now();
    for (int k = 0; k < chunks; ++k) chunk();
    const double t_compute = seconds_since(t0);

    nlohmann::json out = {{"bytes", block * n_ * 4}, {"comm_alone_s", t_comm}, {"compute_chunks", chunks}};
    for (bool poll : {false, true}) {
      barrier();
      t0 = clock_type::now();
      Work w = c_->all_gather<float>(send, recv);
      for (int k = 0; k < chunks; ++k) {
        chunk();
        if (poll) w.test();
      }
      const double t_before_wait = seconds_since(t0);
      w.wait();
      const double exposed = seconds_since(t0) - t_before_wait;
      out[poll ? "exposed_wait_polling_s" : "exposed_wait_no_polling_s"] = max_over_ranks(exposed);
      out[poll ? "slowdown_polling" : "slowdown_no_polling"] = max_over_ranks(seconds_since(t0) / t_compute);
    }
    out["compute_alone_s"] = max_over_ranks(t_compute);
    return out;
  }

  std::string algorithm_name() const {
    return c_->options().v_algorithm == VAlgorithm::native ? "native" : "per_owner";
  }

 private:
  std::shared_ptr<Comm> c_;
  int n_, me_, iters_;
};

void run(const std::string& bytes_list, int iters, bool json) {
  auto options = dmuon::comm::Options::from_env();
  auto world = dmuon::comm::world(options);
  std::vector<int64_t> sizes;
  std::size_t start = 0;
  while (start <= bytes_list.size()) {
    std::size_t end = bytes_list.find(',', start);
    if (end == std::string::npos) end = bytes_list.size();
    sizes.push_back(parse_bytes(bytes_list.substr(start, end - start)));
    start = end + 1;
  }
  auto per_owner = options, native = options;
  per_owner.v_algorithm = VAlgorithm::per_owner;
  native.v_algorithm = VAlgorithm::native;
  auto per_owner_comm = dmuon::comm::world(per_owner);
  auto native_comm = dmuon::comm::world(native);

  Bench bench(world, iters);
  std::vector<Row> rows;
  for (int64_t bytes : sizes) {
    for (auto& r : bench.run_size(bytes)) rows.push_back(r);
    for (auto& r : bench.run_uneven(bytes, per_owner_comm, "per_owner")) rows.push_back(r);
    for (auto& r : bench.run_uneven(bytes, native_comm, "native")) rows.push_back(r);
  }
  nlohmann::json overlap = bench.overlap(*std::max_element(sizes.begin(), sizes.end()));
  if (world->rank() != 0) return;

  const auto& topo = world->topology();
  if (json) {
    nlohmann::json out = {{"ranks", world->size()},
                          {"nodes", topo.nodes},
                          {"ranks_per_node", topo.ranks_per_node},
                          {"results", nlohmann::json::array()},
                          {"overlap", overlap}};
    for (const Row& r : rows)
      out["results"].push_back({{"collective", r.collective},
                                {"algorithm", r.algorithm},
                                {"bytes", r.bytes},
                                {"time_us", r.seconds * 1e6},
                                {"algbw_GBps", r.algbw},
                                {"busbw_GBps", r.busbw},
                                {"wrong", r.wrong}});
    std::printf("%s\n", out.dump().c_str());
    return;
  }
  std::printf("dmuon bench comm: %d ranks (%d nodes x %d), float32, time = max over ranks of the mean\n", world->size(),
              topo.nodes, topo.ranks_per_node);
  std::printf("%-24s %-10s %12s %12s %10s %10s %7s\n", "collective", "algorithm", "bytes", "time_us", "algbw_GB/s",
              "busbw_GB/s", "wrong");
  for (const Row& r : rows)
    std::printf("%-24s %-10s %12lld %12.1f %10.3f %10.3f %7lld\n", r.collective.c_str(), r.algorithm.c_str(),
                static_cast<long long>(r.bytes), r.seconds * 1e6, r.algbw, r.busbw, static_cast<long long>(r.wrong));
  std::printf(
      "overlap: all_gather of %lld bytes alone %.1f us; compute alone %.1f us; exposed wait without polling %.1f us, "
      "with polling %.1f us\n",
      static_cast<long long>(overlap["bytes"].get<int64_t>()), overlap["comm_alone_s"].get<double>() * 1e6,
      overlap["compute_alone_s"].get<double>() * 1e6, overlap["exposed_wait_no_polling_s"].get<double>() * 1e6,
      overlap["exposed_wait_polling_s"].get<double>() * 1e6);
}

dmuon::cli::Registration reg("", [](CLI::App& app) {
  auto* c = app.add_subcommand("comm", "Bus bandwidth and correctness of each collective (run under mpirun -np N)");
  auto bytes = std::make_shared<std::string>("64K,1M,16M");
  auto iters = std::make_shared<int>(20);
  auto json = std::make_shared<bool>(false);
  c->add_option("--bytes", *bytes, "Comma-separated buffer sizes (suffix K, M, G)")->capture_default_str();
  c->add_option("--iters", *iters, "Most timed iterations per size (fewer for large sizes, at least 3)")
      ->capture_default_str()
      ->check(dmuon::cli::at_least(1));
  c->add_flag("--json", *json, "Print one JSON object (rank 0)");
  c->callback([=] { run(*bytes, *iters, *json); });
});

}  // namespace comm_bench
