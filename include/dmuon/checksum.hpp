// FNV-1a 64-bit hash of a byte string: the checkpoint files' checksum, the GPT example's per-parameter
// random streams and the cross-rank consistency checks (parameter registry, collective handshakes).
// Not cryptographic; it catches truncation, bit flips and swapped files, which is what a checkpoint
// loader must refuse. Offset basis 0xcbf29ce484222325, prime 0x100000001b3
// (http://www.isthe.com/chongo/tech/comp/fnv/).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dmuon {

inline constexpr uint64_t kFnv1a64Basis = 0xcbf29ce484222325ull;

// With `hash` the value so far, continues it: fnv1a64(b, fnv1a64(a)) == fnv1a64(a + b).
uint64_t fnv1a64(std::string_view bytes, uint64_t hash = kFnv1a64Basis);
// The bytes of `n` trivially copyable values (in this machine's byte order: for checks between ranks
// of one job, not for files).
template <typename T>
uint64_t fnv1a64_values(const T* values, std::size_t n, uint64_t hash = kFnv1a64Basis) {
  return fnv1a64(std::string_view(reinterpret_cast<const char*>(values), n * sizeof(T)), hash);
}
// 16 lowercase hex digits, as stored in checkpoint indexes.
std::string fnv1a64_hex(std::string_view bytes);

}  // namespace dmuon
