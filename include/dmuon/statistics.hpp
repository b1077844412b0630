// The one definition of "median" that every figure of dmuon reports (benchmarks, `dmuon compare`,
// `dmuon train`'s summary): the middle value of the sorted values, and for an even count the mean of
// the two middle ones. So 2 timed steps report their mean, and 8 steps the mean of the 4th and 5th
// fastest.
#pragma once

#include <algorithm>
#include <vector>

namespace dmuon {

// 0 for no values (a run with no timed steps reports zero times).
inline double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

}  // namespace dmuon
