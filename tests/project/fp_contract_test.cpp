// The host code never fuses a multiply and an add into one FMA (CMakeLists.txt: -ffp-contract=off): the bit-exact
// host references (tests/support/ns_reference.hpp, the update rules' comparisons) round each product as written.
// GCC fuses a·b + c for C++ by default wherever the target has FMA (aarch64, -march=x86-64-v3); baseline x86-64
// has none, so here the function is compiled for an FMA target and run where the CPU has one.
#include <gtest/gtest.h>

namespace {

#if defined(__x86_64__)
[[gnu::noinline, gnu::target("fma")]]
#else
[[gnu::noinline]]
#endif
double mul_add(double a, double b, double c) {
  return a * b + c;
}

TEST(FpContract, ProductRoundsBeforeTheSum) {
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("fma")) GTEST_SKIP() << "this CPU has no FMA instruction";
#endif
  // a·b = 1 − 2⁻⁶⁰ exactly, 1 once rounded: 0 with two roundings, −2⁻⁶⁰ fused.
  volatile double a = 1 + 0x1p-30, b = 1 - 0x1p-30, c = -1;
  EXPECT_EQ(mul_add(a, b, c), 0.0);
}

}  // namespace
