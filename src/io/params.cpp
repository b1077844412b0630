#include "dmuon/params.hpp"

#include "dmuon/error.hpp"
#include "dmuon/shape.hpp"

namespace dmuon {

std::string_view to_string(ParamRole role) { return role == ParamRole::matrix ? "matrix" : "elementwise"; }

ParamRole parse_param_role(std::string_view text) {
  if (text == "matrix") return ParamRole::matrix;
  if (text == "elementwise") return ParamRole::elementwise;
  DMUON_FAIL("unknown parameter role '", text, "' (expected matrix or elementwise)");
}

int64_t ParamSpec::numel() const { return checked_numel(shape, "parameter '" + name + "'"); }

int64_t ParamSpec::rows() const { return shape.empty() ? 1 : shape[0]; }

int64_t ParamSpec::cols() const { return shape.empty() ? 1 : numel() / (shape[0] == 0 ? 1 : shape[0]); }

}  // namespace dmuon
