// SumOfSquares on the CPU backend: sum_of_squares.hpp's loop, into *sum on the host.
#include "backend/rules/launch.hpp"
#include "backend/rules/sum_of_squares.hpp"

namespace dmuon::rules {

template <>
void run_on_cpu(const SumOfSquares& rule) {
  *rule.sum = sum_of_squares_loop(rule.grad.data(), static_cast<int64_t>(rule.grad.size()), rule.grad_scale);
}

}  // namespace dmuon::rules
