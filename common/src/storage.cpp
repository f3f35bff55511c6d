// Freeing and refilling a tensor's storage (dtc/storage.h).
#include "dtc/storage.h"

#include <fmt/format.h>

#include <stdexcept>

namespace dtc {

void free_storage(const torch::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));  // the old DataPtr frees it
  impl->set_nbytes(0);
}

void refill_storage(const torch::Tensor& into, const torch::Tensor& from) {
  c10::StorageImpl* dst = into.storage().unsafeGetStorageImpl();
  c10::StorageImpl* src = from.storage().unsafeGetStorageImpl();
  if (dst->nbytes() != 0) {
    throw std::invalid_argument(
        "refill_storage: the target's storage still holds memory: free_storage() it first");
  }
  const auto whole = [](const torch::Tensor& t) {
    return t.is_contiguous() && t.storage_offset() == 0;
  };
  if (!whole(into) || !whole(from) || into.numel() != from.numel() ||
      into.dtype() != from.dtype() || into.device() != from.device() ||
      src->nbytes() != static_cast<size_t>(from.nbytes())) {
    throw std::invalid_argument(
        fmt::format("refill_storage: the tensors must be whole, contiguous and alike (into {} "
                    "elements, from {}, whose storage holds {} bytes)",
                    into.numel(), from.numel(), src->nbytes()));
  }
  const size_t nbytes = src->nbytes();
  dst->set_data_ptr_noswap(src->set_data_ptr(at::DataPtr(nullptr, from.device())));
  dst->set_nbytes(nbytes);
  src->set_nbytes(0);
}

}  // namespace dtc
