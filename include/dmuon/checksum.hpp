// FNV-1a 64-bit hash of a byte string: the checkpoint files' checksum. Not cryptographic; it catches
// truncation, bit flips and swapped files, which is what a checkpoint loader must refuse.
// Offset basis 0xcbf29ce484222325, prime 0x100000001b3 (http://www.isthe.com/chongo/tech/comp/fnv/).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace dmuon {

uint64_t fnv1a64(std::string_view bytes);
// 16 lowercase hex digits, as stored in checkpoint indexes.
std::string fnv1a64_hex(std::string_view bytes);

}  // namespace dmuon
