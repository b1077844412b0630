// Fuzz target: hardware profiles as in models/hardware/*.json (load_hardware_profile), then the
// rescaling every simulation applies to them.
#include "dmuon/sim.hpp"
#include "fuzz_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dmuon::fuzz::write_scratch("profile.json", dmuon::fuzz::as_text(data, size));
  dmuon::fuzz::expect_only_dmuon_errors([&] {
    const dmuon::HardwareProfile hw = dmuon::load_hardware_profile(path);
    dmuon::sim::at_devices(hw, 3);
  });
  return 0;
}
