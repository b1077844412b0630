#include "dmuon/checksum.hpp"

#include <cstdio>

namespace dmuon {

uint64_t fnv1a64(std::string_view bytes, uint64_t hash) {
  uint64_t h = hash;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string fnv1a64_hex(std::string_view bytes) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(fnv1a64(bytes)));
  return buf;
}

}  // namespace dmuon
