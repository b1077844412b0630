#include "dmuon/npy.hpp"

#include <charconv>
#include <cstring>
#include <regex>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "dmuon/shape.hpp"

namespace dmuon {

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

// Value of `key` in the header dict, e.g. 'descr': '<f4' -> "'<f4'"; empty when absent.
std::string dict_value(const std::string& header, const std::string& key, const std::string& pattern) {
  std::smatch m;
  std::regex re("['\"]" + key + "['\"]\\s*:\\s*(" + pattern + ")");
  return std::regex_search(header, m, re) ? m[1].str() : std::string();
}

std::vector<int64_t> parse_shape(const std::string& tuple, const std::string& path) {
  // tuple is "(a, b, )" or "()" for a scalar.
  std::vector<int64_t> shape;
  std::string inner = tuple.substr(1, tuple.size() - 2);
  std::regex item("\\s*(\\d+)\\s*(,|$)");
  size_t consumed = 0;
  for (std::sregex_iterator it(inner.begin(), inner.end(), item), end; it != end; ++it) {
    DMUON_CHECK(static_cast<size_t>(it->position()) == consumed, path, ": malformed shape ", tuple);
    const std::string digits = (*it)[1].str();
    int64_t d = 0;
    const auto [stop, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), d);
    DMUON_CHECK(ec == std::errc() && stop == digits.data() + digits.size(), path, ": malformed shape ", tuple,
                " (dimension ", digits, " is too large)");
    shape.push_back(d);
    consumed = it->position() + it->length();
  }
  DMUON_CHECK(inner.find_first_not_of(" ", consumed) == std::string::npos, path, ": malformed shape ", tuple);
  return shape;
}

}  // namespace

NpyArray read_npy(const std::string& path) {
  const std::string bytes = read_file(path);
  DMUON_CHECK(bytes.size() >= kMagicLen + 4 && std::memcmp(bytes.data(), kMagic, kMagicLen) == 0, path,
              ": not a .npy file (bad magic)");
  const auto major = static_cast<unsigned char>(bytes[6]);
  DMUON_CHECK(major >= 1 && major <= 3, path, ": unsupported .npy format version ", int(major));
  size_t header_len = 0;
  size_t header_start = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | (static_cast<unsigned char>(bytes[9]) << 8);
    header_start = 10;
  } else {
    DMUON_CHECK(bytes.size() >= 12, path, ": truncated header");
    for (int i = 3; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(bytes[8 + i]);
    header_start = 12;
  }
  DMUON_CHECK(bytes.size() >= header_start + header_len, path, ": truncated header");
  const std::string header = bytes.substr(header_start, header_len);

  const std::string descr = dict_value(header, "descr", "'[^']*'|\"[^\"]*\"");
  const std::string order = dict_value(header, "fortran_order", "True|False");
  const std::string shape_text = dict_value(header, "shape", "\\([^)]*\\)");
  DMUON_CHECK(!descr.empty() && !order.empty() && !shape_text.empty(), path,
              ": malformed header (needs descr, fortran_order and shape): ", header);

  NpyArray out;
  const std::string dtype = descr.substr(1, descr.size() - 2);
  size_t itemsize = 0;
  if (dtype == "<f4" || dtype == "=f4") {
    itemsize = 4;
    out.source_dtype = "float32";
  } else if (dtype == "<f8" || dtype == "=f8") {
    itemsize = 8;
    out.source_dtype = "float64";
  } else {
    DMUON_FAIL(path, ": unsupported dtype '", dtype, "' (supported: little-endian float32 '<f4', float64 '<f8')");
  }
  out.shape = parse_shape(shape_text, path);
  const auto count = static_cast<size_t>(checked_numel(out.shape, path));

  const size_t data_start = header_start + header_len;
  const size_t want = count * itemsize;
  const size_t have = bytes.size() - data_start;
  DMUON_CHECK(have == want, path, ": data is ", have, " bytes but shape ", shape_text, " of ", out.source_dtype,
              " needs ", want, have < want ? " (truncated file)" : " (trailing bytes)");

  std::vector<float> raw(count);
  const char* src = bytes.data() + data_start;
  if (itemsize == 4) {
    if (want > 0) std::memcpy(raw.data(), src, want);  // an empty array's data() may be null
  } else {
    for (size_t i = 0; i < count; ++i) {
      double v;
      std::memcpy(&v, src + i * 8, 8);
      raw[i] = static_cast<float>(v);
    }
  }
  const bool fortran = order == "True";
  if (!fortran || out.shape.size() < 2) {
    out.data = std::move(raw);
    return out;
  }
  // Fortran order: index i0 varies fastest. Convert to C order by walking C indices.
  out.data.resize(count);
  const size_t nd = out.shape.size();
  std::vector<size_t> fstride(nd, 1);
  for (size_t d = 1; d < nd; ++d) fstride[d] = fstride[d - 1] * static_cast<size_t>(out.shape[d - 1]);
  std::vector<int64_t> idx(nd, 0);
  for (size_t c = 0; c < count; ++c) {
    size_t f = 0;
    for (size_t d = 0; d < nd; ++d) f += static_cast<size_t>(idx[d]) * fstride[d];
    out.data[c] = raw[f];
    for (size_t d = nd; d-- > 0;) {
      if (++idx[d] < out.shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

void write_npy(const std::string& path, const std::vector<int64_t>& shape, const float* data) {
  std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (";
  const auto count = static_cast<size_t>(checked_numel(shape, path));
  for (int64_t d : shape) dict += std::to_string(d) + ", ";
  if (shape.size() > 1) dict.resize(dict.size() - 1);  // "(3, 4)" not "(3, 4, )"
  if (shape.size() > 1) dict.back() = ')';
  else dict += ")";
  dict += ", }";
  // Pad so that magic + version + length + header is a multiple of 64, ending in '\n'.
  const size_t prefix = kMagicLen + 2 + 2;
  size_t total = prefix + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict += '\n';
  std::string bytes(kMagic, kMagicLen);
  bytes += '\x01';
  bytes += '\x00';
  bytes += static_cast<char>(dict.size() & 0xff);
  bytes += static_cast<char>((dict.size() >> 8) & 0xff);
  bytes += dict;
  bytes.append(reinterpret_cast<const char*>(data), count * sizeof(float));
  write_file_atomically(path, bytes);
}

}  // namespace dmuon
