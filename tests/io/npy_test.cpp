#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "dmuon/npy.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

// A .npy file assembled by hand: version 1.0 header padded to 64 bytes, then `payload`.
std::string npy_bytes(const std::string& dict, const std::string& payload) {
  std::string header = dict;
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  return out + header + payload;
}

template <typename T>
std::string raw(std::initializer_list<T> values) {
  std::string s;
  for (T v : values) s.append(reinterpret_cast<const char*>(&v), sizeof(T));
  return s;
}

TEST(Npy, ReadsGoldenFloat32) {
  NpyArray a = test::load_golden("ns_wide_in.npy");
  ASSERT_EQ(a.shape, (std::vector<int64_t>{64, 160}));
  EXPECT_EQ(a.data.size(), 64u * 160u);
  EXPECT_EQ(a.source_dtype, "float32");
}

TEST(Npy, RoundTripsShapes) {
  test::TempDir dir;
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{3, 5}, {7}, {}, {2, 3, 4}, {0, 4}}) {
    size_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = 0.25f * i - 1.0f;
    write_npy(dir.file("a.npy"), shape, v.data());
    NpyArray back = read_npy(dir.file("a.npy"));
    EXPECT_EQ(back.shape, shape);
    EXPECT_EQ(back.data, v);
  }
}

TEST(Npy, ConvertsFloat64AndFortranOrder) {
  test::TempDir dir;
  // 2x3 matrix [[1,2,3],[4,5,6]] stored column-major as float64.
  write_file_atomically(dir.file("f.npy"), npy_bytes("{'descr': '<f8', 'fortran_order': True, 'shape': (2, 3), }",
                                                     raw<double>({1, 4, 2, 5, 3, 6})));
  NpyArray a = read_npy(dir.file("f.npy"));
  EXPECT_EQ(a.source_dtype, "float64");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.data, (std::vector<float>{1, 2, 3, 4, 5, 6}));
}

void expect_rejected(const std::string& bytes, const std::string& fragment) {
  test::TempDir dir;
  write_file_atomically(dir.file("bad.npy"), bytes);
  try {
    read_npy(dir.file("bad.npy"));
    FAIL() << "accepted a bad file; expected an error containing '" << fragment << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad.npy"), std::string::npos) << "error must name the file: " << e.what();
  }
}

TEST(Npy, RejectsBadFiles) {
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }";
  expect_rejected("hello world, not numpy", "bad magic");
  expect_rejected(npy_bytes(dict, raw<float>({1, 2, 3})), "truncated");
  expect_rejected(npy_bytes(dict, raw<float>({1, 2, 3, 4, 5})), "trailing");
  expect_rejected(npy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 2), }", raw<int>({1, 2, 3, 4})),
                  "unsupported dtype");
  expect_rejected(npy_bytes("{'descr': '>f4', 'fortran_order': False, 'shape': (2, 2), }", raw<float>({1, 2, 3, 4})),
                  "unsupported dtype");
  expect_rejected(npy_bytes("{'descr': '<f4', 'shape': (2, 2), }", raw<float>({1, 2, 3, 4})), "malformed header");
  expect_rejected(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }", raw<float>({1, 2, 3, 4})),
                  "malformed");
  expect_rejected(npy_bytes(dict, raw<float>({1, 2, 3, 4})).substr(0, 20), "truncated header");
}

// Shapes whose element count overflows or cannot be allocated: each is a dmuon::Error naming the file
// (expect_rejected checks "bad.npy"), never a wrapped count, a crash or a std:: exception.
TEST(Npy, RejectsOverflowingAndHugeShapes) {
  const auto with_shape = [](const std::string& shape) {
    return "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
  };
  // 2^32 · 2^32 wraps a 64-bit count to 0, which an empty payload then "matches".
  expect_rejected(npy_bytes(with_shape("(4294967296, 4294967296)"), ""), "more than 2^40 elements");
  // (2^62 + 1) · 4 bytes wraps to 4 bytes: one float "matches", and no vector can hold the count.
  expect_rejected(npy_bytes(with_shape("(4611686018427387905, 1)"), raw<float>({1})), "more than 2^40 elements");
  // Fits in int64, but no float32 tensor here is 2^41 elements.
  expect_rejected(npy_bytes(with_shape("(2199023255552,)"), ""), "more than 2^40 elements");
  // A dimension with more digits than an int64 holds.
  expect_rejected(npy_bytes(with_shape("(123456789012345678901234567890, 1)"), ""), "malformed shape");
}

TEST(Npy, WriteRefusesOverflowingShapesNamingTheFile) {
  test::TempDir dir;
  const float one = 1;
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{int64_t{1} << 32, int64_t{1} << 32}, {-1, 2}}) {
    try {
      write_npy(dir.file("huge.npy"), shape, &one);
      ADD_FAILURE() << "write_npy accepted shape (" << shape[0] << ", " << shape[1] << ")";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("huge.npy"), std::string::npos) << e.what();
    }
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("huge.npy")));
}

TEST(Npy, MissingFileIsNamed) {
  try {
    read_npy("/nonexistent/dir/x.npy");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/x.npy"), std::string::npos);
  }
}

}  // namespace
}  // namespace dmuon
