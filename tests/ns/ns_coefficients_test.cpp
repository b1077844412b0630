// Coefficient schedules (DESIGN 2.4), the automatic algorithm choice and the CLI names.
#include <gtest/gtest.h>

#include <cmath>

#include "dmuon/error.hpp"
#include "dmuon/ns.hpp"

namespace dmuon {
namespace {

void expect_step(const NsStep& got, double a, double b, double c) {
  EXPECT_DOUBLE_EQ(got.a, a);
  EXPECT_DOUBLE_EQ(got.b, b);
  EXPECT_DOUBLE_EQ(got.c, c);
}

TEST(NsSchedule, KellerRepeatsItsRow) {
  const auto s = ns_schedule(NsCoeffs::keller, 7);
  ASSERT_EQ(s.size(), 7u);
  for (const NsStep& r : s) expect_step(r, 3.4445, -4.7750, 2.0315);
  EXPECT_TRUE(ns_schedule(NsCoeffs::keller, 0).empty());
}

TEST(NsSchedule, YouRepeatsLastRowPastTheTable) {
  const auto s = ns_schedule(NsCoeffs::you, 8);
  ASSERT_EQ(s.size(), 8u);
  expect_step(s[0], 4.0848, -6.8946, 2.9270);
  expect_step(s[3], 2.8769, -3.1427, 1.2046);
  for (int t = 4; t < 8; ++t) expect_step(s[t], 2.8366, -3.0525, 1.2012);
}

TEST(NsSchedule, PolarExpressSafety) {
  EXPECT_DOUBLE_EQ(ns_default_safety(NsCoeffs::polar_express), 1.01);
  EXPECT_DOUBLE_EQ(ns_default_safety(NsCoeffs::keller), 1.0);
  for (double s : {1.01, 1.05}) {
    const auto rows = ns_schedule(NsCoeffs::polar_express, 10, s == 1.01 ? 0.0 : s);
    ASSERT_EQ(rows.size(), 10u);
    expect_step(rows[0], 8.28721201814563 / s, -23.595886519098837 / (s * s * s), 17.300387312530933 / std::pow(s, 5));
    expect_step(rows[4], 2.300652019954817 / s, -1.6689039845747493 / (s * s * s), 0.4188073119525673 / std::pow(s, 5));
    expect_step(rows[6], 1.8750014808534479 / s, -1.2500016453999487 / (s * s * s),
                0.3750001645474248 / std::pow(s, 5));
    // The converged final row is left unscaled, and repeats.
    for (int t = 7; t < 10; ++t) expect_step(rows[t], 1.875, -1.25, 0.375);
  }
}

TEST(NsSchedule, SafetyAppliesToKeller) {
  const double s = 1.1;
  expect_step(ns_schedule(NsCoeffs::keller, 1, s)[0], 3.4445 / s, -4.7750 / (s * s * s), 2.0315 / std::pow(s, 5));
}

TEST(NsSchedule, RejectsNegativeSteps) { EXPECT_THROW(ns_schedule(NsCoeffs::keller, -1), Error); }

TEST(NsAlgoChoice, GramFromAspectTwo) {
  EXPECT_EQ(ns_resolve_algo(NsAlgo::automatic, 896, 4864), NsAlgo::gram);
  EXPECT_EQ(ns_resolve_algo(NsAlgo::automatic, 4864, 896), NsAlgo::gram);
  EXPECT_EQ(ns_resolve_algo(NsAlgo::automatic, 100, 200), NsAlgo::gram);
  EXPECT_EQ(ns_resolve_algo(NsAlgo::automatic, 100, 199), NsAlgo::standard);
  EXPECT_EQ(ns_resolve_algo(NsAlgo::automatic, 896, 896), NsAlgo::standard);
  EXPECT_EQ(ns_resolve_algo(NsAlgo::standard, 10, 1000), NsAlgo::standard);
  EXPECT_EQ(ns_resolve_algo(NsAlgo::gram, 10, 10), NsAlgo::gram);
}

TEST(NsNames, RoundTripAndReject) {
  for (NsAlgo a : {NsAlgo::standard, NsAlgo::gram, NsAlgo::automatic}) EXPECT_EQ(parse_ns_algo(to_string(a)), a);
  for (NsCoeffs c : {NsCoeffs::keller, NsCoeffs::you, NsCoeffs::polar_express})
    EXPECT_EQ(parse_ns_coeffs(to_string(c)), c);
  for (NsBatchMode m : {NsBatchMode::sequential, NsBatchMode::concurrent})
    EXPECT_EQ(parse_ns_batch_mode(to_string(m)), m);
  EXPECT_EQ(to_string(NsAlgo::automatic), "auto");
  EXPECT_EQ(to_string(NsCoeffs::polar_express), "polar-express");
  try {
    parse_ns_coeffs("polar");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("polar-express"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_ns_algo("fast"), Error);
  EXPECT_THROW(parse_ns_batch_mode("parallel"), Error);
}

TEST(NsNames, Restarts) {
  EXPECT_EQ(parse_ns_restarts("2"), std::vector<int>{2});
  EXPECT_EQ(parse_ns_restarts("1,3"), (std::vector<int>{1, 3}));
  EXPECT_TRUE(parse_ns_restarts("").empty());
  EXPECT_TRUE(parse_ns_restarts("none").empty());
  for (const char* bad : {"1,", "x", "-1", "2;3", "1.5"}) EXPECT_THROW(parse_ns_restarts(bad), Error) << bad;
}

}  // namespace
}  // namespace dmuon
