// FNV-1a 64 (the checkpoint checksum) against known answers: the empty string
// (the offset basis), "a" and "foobar" from the published FNV test vectors, and two bytes (0xff, 0x00)
// worked out apart from this code.
// Saving and loading share the function, so a wrong constant would pass every round trip.
#include <gtest/gtest.h>

#include "dmuon/checksum.hpp"

namespace dmuon {
namespace {

TEST(Checksum, Fnv1a64KnownAnswers) {
  EXPECT_EQ(fnv1a64(""), 0xcbf29ce484222325ull);  // the offset basis
  EXPECT_EQ(fnv1a64("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("foobar"), 0x85944171f73967e8ull);
  EXPECT_EQ(fnv1a64_hex(""), "cbf29ce484222325");
  EXPECT_EQ(fnv1a64_hex("a"), "af63dc4c8601ec8c");
  // Bytes above 0x7f and zeros count as themselves (no sign extension, no C-string end).
  EXPECT_EQ(fnv1a64(std::string_view("\xff\x00", 2)), 0x0a99a607b6f60beaull);
}

}  // namespace
}  // namespace dmuon
