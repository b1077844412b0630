// The single-process Muon. Kept apart from optimizer.cpp so code that supplies its own Orthogonalizer
// does not link the NS engine.
#include "dmuon/ns.hpp"
#include "dmuon/optim.hpp"

namespace dmuon {

Muon::Muon(std::vector<ParamRef> params, OptimizerOptions options)
    : Optimizer(std::move(params), options, ns_orthogonalizer(options.muon.ns)) {}

Muon::Muon(std::vector<ParamRef> params, OptimizerOptions options, Orthogonalizer orth)
    : Optimizer(std::move(params), std::move(options), std::move(orth)) {}

}  // namespace dmuon
