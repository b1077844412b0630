// What a parameter is, independent of where it lives: its name, shape, optimizer role and unit.
// Shared by the model manifests, the parameter registry, the planner and the optimizers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dmuon {

// matrix: a hidden 2-D (or 4-D conv, viewed as 2-D) weight updated by Muon.
// elementwise: embeddings, output head, norms, biases, scalars: updated by AdamW.
enum class ParamRole { matrix, elementwise };

std::string_view to_string(ParamRole role);
// "matrix" or "elementwise"; throws dmuon::Error otherwise.
ParamRole parse_param_role(std::string_view text);

struct ParamSpec {
  std::string name;            // e.g. "layers.3.mlp.up_proj.weight"
  std::vector<int64_t> shape;  // e.g. {4864, 896}
  ParamRole role = ParamRole::elementwise;
  int unit = 0;                // sharding unit (layer); units run in forward order 0, 1, ...

  int64_t numel() const;
  // Matrix view: rows = shape[0], cols = product of the other dimensions (conv (out, in·kh·kw)).
  int64_t rows() const;
  int64_t cols() const;
};

// A block of a rows×cols matrix, [row0, row0+rows) × [col0, col0+cols): what split Newton–Schulz orthogonalizes on
// its own (optim.hpp: muon_blocks), and what the planner costs it as (plan.hpp: make_plan_items).
struct MatrixBlock {
  int64_t row0 = 0, col0 = 0;
  int64_t rows = 0, cols = 0;

  bool operator==(const MatrixBlock&) const = default;
};

}  // namespace dmuon
