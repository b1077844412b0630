#include "dmuon/shape.hpp"

#include <sstream>

#include "dmuon/error.hpp"

namespace dmuon {

int64_t checked_numel(std::span<const int64_t> shape, std::string_view what) {
  int64_t n = 1;
  for (int64_t d : shape) {
    DMUON_CHECK(d >= 0, what, ": shape ", shape_text(shape), " has a negative dimension");
    // Checked before multiplying, so a zero elsewhere in the shape cannot hide a huge dimension.
    DMUON_CHECK(d <= kMaxTensorElements && (n == 0 || d == 0 || n <= kMaxTensorElements / d), what, ": shape ",
                shape_text(shape), " has more than 2^40 elements (corrupt or crafted shape?)");
    n *= d;
  }
  return n;
}

std::string shape_text(std::span<const int64_t> shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  return os.str() + ']';
}

}  // namespace dmuon
