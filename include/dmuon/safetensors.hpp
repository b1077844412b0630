// safetensors files (https://github.com/huggingface/safetensors): an 8-byte little-endian header
// length N, N bytes of JSON {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
// "__metadata__": {"key": "value"}}, then the data buffer. Offsets are relative to the buffer's start.
// Reading is strict: every tensor's byte range must match dtype·shape, lie inside the buffer and not
// overlap another, and the ranges must cover the buffer exactly; errors name the file and the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace dmuon {

struct SafetensorsTensor {
  std::string dtype;           // "F32", "F64", "I64", "I32", "I16", "I8", "U8", "F16", "BF16", "BOOL"
  std::vector<int64_t> shape;  // {} for a scalar
  std::string bytes;           // little-endian values, C order; size = numel · dtype size
};

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;        // "__metadata__" (string → string)
  std::map<std::string, SafetensorsTensor> tensors;   // by name; written in this (sorted) order
};

// Bytes per element of a safetensors dtype; throws dmuon::Error for an unknown one.
size_t safetensors_dtype_size(std::string_view dtype);

// Serialises `file`; the JSON header is padded with spaces to a multiple of 8 bytes.
std::string encode_safetensors(const SafetensorsFile& file);
// Parses and validates; `source` (usually the path) names the file in errors.
SafetensorsFile decode_safetensors(std::string_view bytes, const std::string& source);

// Atomic write (temporary file, fsync, rename) and a strict read.
void write_safetensors(const std::string& path, const SafetensorsFile& file);
SafetensorsFile read_safetensors(const std::string& path);

// Builders and typed views.
SafetensorsTensor f32_tensor(std::vector<int64_t> shape, const float* data);
SafetensorsTensor i64_tensor(std::vector<int64_t> shape, const int64_t* data);
// The tensor `name` of `file` as float32 / int64 values; errors name `source`, the tensor, and a
// wrong dtype or a missing tensor.
std::vector<float> get_f32(const SafetensorsFile& file, const std::string& name, const std::string& source);
std::vector<int64_t> get_i64(const SafetensorsFile& file, const std::string& name, const std::string& source);

}  // namespace dmuon
