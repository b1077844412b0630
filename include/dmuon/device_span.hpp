// DeviceSpan<T>: a non-owning typed view of `size` contiguous elements in a backend's memory (gemma.cpp's
// MatPtrT, in one dimension). What an owner of backend memory (ShardedParams) hands out in place of a
// std::span, which the host could dereference even where the memory is a GPU's: the host reaches the elements
// only through host() (where the backend's memory is host memory) or to_host() (a copy); the backend's
// operations take data().
#pragma once

#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

#include "dmuon/backend.hpp"
#include "dmuon/error.hpp"

namespace dmuon {

template <typename T>
class DeviceSpan {
 public:
  DeviceSpan() = default;
  DeviceSpan(Backend& backend, T* data, size_t size) : backend_(&backend), data_(data), size_(size) {}
  // A read-only view of a writable one.
  template <typename U>
    requires std::is_same_v<const U, T>
  DeviceSpan(const DeviceSpan<U>& other) : backend_(other.backend_), data_(other.data_), size_(other.size_) {}

  T* data() const { return data_; }
  size_t size() const { return size_; }
  size_t size_bytes() const { return size_ * sizeof(T); }
  bool empty() const { return size_ == 0; }
  Backend& backend() const { return *backend_; }  // not on a default-constructed view
  // Elements [offset, offset + count).
  DeviceSpan subspan(size_t offset, size_t count) const {
    DMUON_CHECK(offset + count <= size_, "subspan [", offset, ", ", offset + count, ") of a view of ", size_,
                " elements");
    return {*backend_, data_ + offset, count};
  }
  // The elements for the host to read and write in place: only where the backend's memory is host memory.
  std::span<T> host() const {
    DMUON_CHECK(empty() || backend_->host_memory(), "a view of ", backend_->description(),
                " memory read on the host (copy it with to_host)");
    return {data_, size_};
  }
  // A host copy of the elements (on a GPU a transfer that waits for the queue).
  std::vector<std::remove_const_t<T>> to_host() const {
    std::vector<std::remove_const_t<T>> out(size_);
    if (size_ > 0) backend_->copy_to_host(out.data(), data_, size_bytes());
    return out;
  }

 private:
  template <typename>
  friend class DeviceSpan;
  Backend* backend_ = nullptr;
  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace dmuon
