// The optimizer kinds (optimizer_factory.hpp: OptimKind) that the generic tests iterate, one row each: the
// single-process definition a kind's steps must equal, the shard modes, devices and world sizes it is tested
// at. A new kind is one row here (beside its row in src/optim/optimizer_factory.cpp); the tests take the rows
// as GoogleTest parameters, so every one of them runs it:
//   class EachKind : public ::testing::TestWithParam<test::KindRow> {};
//   INSTANTIATE_TEST_SUITE_P(Factory, EachKind, ::testing::ValuesIn(test::optimizer_kinds()), test::kind_name);
// or, for tests of each kind in each of its shard modes, ValuesIn(test::kinds_and_modes()) with kind_mode_name.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "dmuon/optimizer_factory.hpp"
#include "dmuon/shard.hpp"

namespace dmuon::test {

// Where a device test runs a kind: the CPU backend, or the fenced test device (support/fenced_device.hpp:
// memory the host cannot touch, compared with the CPU bit for bit).
enum class TestDevice { cpu, fenced };

struct KindRow {
  OptimKind kind = OptimKind::dmuon;
  // The single-process definition its steps equal on whole tensors: muon (dmuon::Muon on the matrices, AdamW
  // on the rest) or adamw (dmuon::AdamW on every parameter).
  OptimKind reference = OptimKind::muon;
  std::vector<shard::Mode> modes;   // the shard modes it is tested in
  std::vector<TestDevice> devices;  // the devices the device tests run it on
  int max_ranks = 0;                // the world sizes it runs at: 1..max_ranks; 0: every size of the suite
                                    // (DMUON_TEST_WORLD_SIZES). At larger sizes the factory must refuse it.

  bool runs_at(int world_size) const { return max_ranks == 0 || world_size <= max_ranks; }
  bool on(TestDevice device) const;
  std::string name() const;  // "muon_gather": to_string(kind), a GoogleTest name
};

// Every kind of optim_kinds(), in OptimKind's order.
const std::vector<KindRow>& optimizer_kinds();

// A kind in one of its shard modes: the cases of the tests that iterate both.
struct KindMode {
  KindRow row;
  shard::Mode mode = shard::Mode::z3;
  std::string name() const;  // "muon_gather_z3"
};
// Every row in each of its modes; with `device`, the rows tested on it.
std::vector<KindMode> kinds_and_modes();
std::vector<KindMode> kinds_and_modes(TestDevice device);

std::string kind_name(const ::testing::TestParamInfo<KindRow>& info);
std::string kind_mode_name(const ::testing::TestParamInfo<KindMode>& info);
// What GoogleTest prints of a parameter.
void PrintTo(const KindRow& row, std::ostream* os);
void PrintTo(const KindMode& c, std::ostream* os);

}  // namespace dmuon::test
