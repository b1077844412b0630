// The single-process Muon: the production Orthogonalizer (Newton–Schulz from src/ns) by default.
#include "dmuon/ns.hpp"
#include "dmuon/optim.hpp"

namespace dmuon {

Muon::Muon(std::vector<ParamRef> params, OptimizerOptions options)
    : Optimizer(std::move(params), options, ns_orthogonalizer(options.muon.ns)) {}

Muon::Muon(std::vector<ParamRef> params, OptimizerOptions options, Orthogonalizer orth, Backend& backend)
    : Optimizer(std::move(params), std::move(options), std::move(orth), backend) {}

}  // namespace dmuon
