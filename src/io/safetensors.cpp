#include "dmuon/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "dmuon/shape.hpp"

namespace dmuon {

namespace {

// The reference implementation refuses headers above 100 MB; so do we (a corrupt length field
// must not make us allocate gigabytes).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

uint64_t numel_of(const std::vector<int64_t>& shape, const std::string& source, const std::string& name) {
  return static_cast<uint64_t>(checked_numel(shape, source + ": tensor '" + name + "'"));
}

template <typename T>
std::vector<T> typed_values(const SafetensorsFile& file, const std::string& name, const std::string& source,
                            std::string_view dtype) {
  auto it = file.tensors.find(name);
  DMUON_CHECK(it != file.tensors.end(), source, ": tensor '", name, "' is missing");
  DMUON_CHECK(it->second.dtype == dtype, source, ": tensor '", name, "' has dtype ", it->second.dtype, ", expected ",
              dtype);
  std::vector<T> out(it->second.bytes.size() / sizeof(T));
  std::memcpy(out.data(), it->second.bytes.data(), out.size() * sizeof(T));
  return out;
}

SafetensorsTensor raw_tensor(std::string dtype, std::vector<int64_t> shape, const void* data, size_t elem) {
  SafetensorsTensor t{std::move(dtype), std::move(shape), {}};
  t.bytes.assign(static_cast<const char*>(data), numel_of(t.shape, "tensor", "new") * elem);
  return t;
}

}  // namespace

size_t safetensors_dtype_size(std::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  DMUON_FAIL("unknown safetensors dtype '", dtype, "'");
}

std::string encode_safetensors(const SafetensorsFile& file) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    DMUON_CHECK(name != "__metadata__", "a tensor may not be named __metadata__");
    const uint64_t size = numel_of(t.shape, "safetensors", name) * safetensors_dtype_size(t.dtype);
    DMUON_CHECK(size == t.bytes.size(), "tensor '", name, "': ", t.bytes.size(), " bytes for dtype ", t.dtype,
                " and ", t.shape.size(), "-d shape needing ", size);
    header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + size}}};
    offset += size;
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out.reserve(8 + json.size() + offset);
  out += json;
  for (const auto& [name, t] : file.tensors) out += t.bytes;
  return out;
}

SafetensorsFile decode_safetensors(std::string_view bytes, const std::string& source) {
  DMUON_CHECK(bytes.size() >= 8, source, ": truncated safetensors file (", bytes.size(),
              " bytes, the header length alone needs 8)");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(bytes[i]);
  DMUON_CHECK(header_len <= kMaxHeaderBytes, source, ": header length ", header_len, " exceeds the 100 MB limit");
  DMUON_CHECK(header_len <= bytes.size() - 8, source, ": truncated safetensors file (header of ", header_len,
              " bytes, file of ", bytes.size(), ")");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.substr(8, header_len));
  } catch (const nlohmann::json::exception& e) {
    DMUON_FAIL(source, ": malformed safetensors header: ", e.what());
  }
  DMUON_CHECK(header.is_object(), source, ": safetensors header is not a JSON object");
  const std::string_view data = bytes.substr(8 + header_len);

  SafetensorsFile out;
  struct Range {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Range> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      DMUON_CHECK(entry.is_object(), source, ": __metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        DMUON_CHECK(v.is_string(), source, ": __metadata__ value '", k, "' is not a string");
        out.metadata[k] = v.get<std::string>();
      }
      continue;
    }
    DMUON_CHECK(entry.is_object() && entry.contains("dtype") && entry.contains("shape") &&
                    entry.contains("data_offsets"),
                source, ": tensor '", name, "' needs dtype, shape and data_offsets");
    const auto& dtype = entry["dtype"];
    const auto& shape = entry["shape"];
    const auto& offsets = entry["data_offsets"];
    DMUON_CHECK(dtype.is_string(), source, ": tensor '", name, "' has a non-string dtype");
    DMUON_CHECK(shape.is_array(), source, ": tensor '", name, "' has a non-array shape");
    DMUON_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                    offsets[1].is_number_unsigned(),
                source, ": tensor '", name, "' data_offsets must be two non-negative integers");
    SafetensorsTensor t;
    t.dtype = dtype.get<std::string>();
    size_t elem = 0;
    try {
      elem = safetensors_dtype_size(t.dtype);
    } catch (const Error&) {
      DMUON_FAIL(source, ": tensor '", name, "' has unknown dtype '", t.dtype, "'");
    }
    for (const auto& d : shape) {
      DMUON_CHECK(d.is_number_integer(), source, ": tensor '", name, "' has a non-integer dimension");
      t.shape.push_back(d.get<int64_t>());
    }
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    DMUON_CHECK(begin <= end, source, ": tensor '", name, "' has data_offsets [", begin, ", ", end, "] reversed");
    DMUON_CHECK(end <= data.size(), source, ": tensor '", name, "' data_offsets [", begin, ", ", end,
                "] run past the data buffer of ", data.size(), " bytes (truncated file?)");
    const uint64_t expected = numel_of(t.shape, source, name) * elem;
    DMUON_CHECK(end - begin == expected, source, ": tensor '", name, "' holds ", end - begin, " bytes but dtype ",
                t.dtype, " and its shape need ", expected);
    t.bytes.assign(data.substr(begin, end - begin));
    ranges.push_back({begin, end, name});
    out.tensors.emplace(name, std::move(t));
  }
  // The ranges must tile the buffer: no overlap, no gap, nothing after the last one.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  for (const Range& r : ranges) {
    DMUON_CHECK(r.begin >= covered, source, ": tensor '", r.name, "' overlaps another tensor's bytes at offset ",
                r.begin);
    DMUON_CHECK(r.begin == covered, source, ": gap of ", r.begin - covered, " bytes before tensor '", r.name, "'");
    covered = r.end;
  }
  DMUON_CHECK(covered == data.size(), source, ": ", data.size() - covered,
              " trailing bytes after the last tensor (data buffer not fully indexed)");
  return out;
}

void write_safetensors(const std::string& path, const SafetensorsFile& file) {
  write_file_atomically(path, encode_safetensors(file));
}

SafetensorsFile read_safetensors(const std::string& path) { return decode_safetensors(read_file(path), path); }

SafetensorsTensor f32_tensor(std::vector<int64_t> shape, const float* data) {
  return raw_tensor("F32", std::move(shape), data, sizeof(float));
}

SafetensorsTensor i64_tensor(std::vector<int64_t> shape, const int64_t* data) {
  return raw_tensor("I64", std::move(shape), data, sizeof(int64_t));
}

std::vector<float> get_f32(const SafetensorsFile& file, const std::string& name, const std::string& source) {
  return typed_values<float>(file, name, source, "F32");
}

std::vector<int64_t> get_i64(const SafetensorsFile& file, const std::string& name, const std::string& source) {
  return typed_values<int64_t>(file, name, source, "I64");
}

}  // namespace dmuon
