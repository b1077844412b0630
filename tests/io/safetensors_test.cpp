#include "dmuon/safetensors.hpp"

#include <gtest/gtest.h>

#include <string>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

// A safetensors file assembled by hand from a header JSON and a data buffer.
std::string raw_file(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return out + json + data;
}

std::string error_of(const std::string& bytes) {
  try {
    decode_safetensors(bytes, "x.safetensors");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Safetensors, RoundTripsTensorsAndMetadata) {
  test::TempDir dir;
  SafetensorsFile f;
  f.metadata["format"] = "dmuon";
  const float a[6] = {1, -2, 3.5f, 4, 5, 6};
  const int64_t b[1] = {42};
  f.tensors["a"] = f32_tensor({2, 3}, a);
  f.tensors["b"] = i64_tensor({}, b);
  f.tensors["empty"] = f32_tensor({0, 4}, nullptr);
  write_safetensors(dir.file("t.safetensors"), f);
  SafetensorsFile back = read_safetensors(dir.file("t.safetensors"));
  EXPECT_EQ(back.metadata, f.metadata);
  ASSERT_EQ(back.tensors.size(), 3u);
  EXPECT_EQ(back.tensors["a"].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(get_f32(back, "a", "t"), std::vector<float>(a, a + 6));
  EXPECT_EQ(get_i64(back, "b", "t"), std::vector<int64_t>{42});
  EXPECT_TRUE(back.tensors["b"].shape.empty());
  EXPECT_EQ(back.tensors["empty"].shape, (std::vector<int64_t>{0, 4}));
  // Header padded to a multiple of 8 so the data buffer is aligned.
  const std::string bytes = read_file(dir.file("t.safetensors"));
  EXPECT_EQ(static_cast<unsigned char>(bytes[0]) % 8, 0);
}

TEST(Safetensors, ReadsAFileWrittenByTheReferenceLayout) {
  // As the Python library writes it: keys in any order, offsets relative to the buffer.
  const float v[2] = {1.5f, -1};
  std::string data(reinterpret_cast<const char*>(v), 8);
  SafetensorsFile f = decode_safetensors(
      raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"k":"v"}})", data), "ref");
  EXPECT_EQ(get_f32(f, "w", "ref"), (std::vector<float>{1.5f, -1}));
  EXPECT_EQ(f.metadata.at("k"), "v");
}

TEST(Safetensors, RefusesMalformedFilesNamingFileAndTensor) {
  const std::string eight(8, '\0');
  EXPECT_NE(error_of("abc").find("x.safetensors: truncated"), std::string::npos);
  EXPECT_NE(error_of(raw_file("{not json", "")).find("malformed safetensors header"), std::string::npos);
  // Length field larger than the file.
  std::string big = raw_file("{}", "");
  big[0] = 100;
  EXPECT_NE(error_of(big).find("truncated"), std::string::npos);
  // Data truncated: offsets past the buffer.
  EXPECT_NE(error_of(raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(4, 0)))
                .find("tensor 'w' data_offsets [0, 8] run past"),
            std::string::npos);
  // Size does not match dtype and shape.
  EXPECT_NE(error_of(raw_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", eight))
                .find("tensor 'w' holds 8 bytes"),
            std::string::npos);
  // Overlap.
  EXPECT_NE(error_of(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                              eight))
                .find("overlaps"),
            std::string::npos);
  // Gap and trailing bytes.
  EXPECT_NE(error_of(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight)).find("gap"),
            std::string::npos);
  EXPECT_NE(error_of(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", eight))
                .find("trailing bytes"),
            std::string::npos);
  // Unknown dtype, missing field, reversed offsets.
  EXPECT_NE(error_of(raw_file(R"({"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,4]}})", eight.substr(4)))
                .find("tensor 'a' has unknown dtype 'Q7'"),
            std::string::npos);
  EXPECT_NE(error_of(raw_file(R"({"a":{"dtype":"F32","shape":[1]}})", "")).find("tensor 'a' needs"),
            std::string::npos);
  EXPECT_NE(error_of(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", eight)).find("reversed"),
            std::string::npos);
}

// A crafted shape whose count overflows (2^32 · 2^32 wraps to 0, matching empty offsets) or is
// negative is refused, naming the file and the tensor.
TEST(Safetensors, RefusesOverflowingAndNegativeShapes) {
  EXPECT_NE(error_of(raw_file(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", ""))
                .find("x.safetensors: tensor 'w': shape [4294967296, 4294967296] has more than 2^40 elements"),
            std::string::npos);
  EXPECT_NE(error_of(raw_file(R"({"w":{"dtype":"F32","shape":[-2,-2],"data_offsets":[0,16]}})", std::string(16, 0)))
                .find("x.safetensors: tensor 'w': shape [-2, -2] has a negative dimension"),
            std::string::npos);
}

TEST(Safetensors, TypedAccessChecksDtypeAndPresence) {
  SafetensorsFile f;
  const int64_t one = 1;
  f.tensors["n"] = i64_tensor({1}, &one);
  EXPECT_THROW(get_f32(f, "n", "f"), Error);
  EXPECT_THROW(get_f32(f, "missing", "f"), Error);
}

}  // namespace
}  // namespace dmuon
