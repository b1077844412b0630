// Rank 0 tunes, every rank gets the entries (tune.hpp: tune_across_ranks).
#include "dmuon/rank_agreement.hpp"
#include "dmuon/tune.hpp"

namespace dmuon {

std::vector<TuneEntry> tune_across_ranks(comm::Comm& comm, const std::vector<TuneRequest>& requests,
                                         const TuneSessionOptions& options) {
  const std::string json = comm::from_rank0(
      comm, [&] { return tune_entries_to_json(tune_with_cache(requests, options)); },
      "tune Newton-Schulz (cache " + (options.cache_path.empty() ? "at the default path" : options.cache_path) + ")");
  return tune_entries_from_json(json);
}

}  // namespace dmuon
