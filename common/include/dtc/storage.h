// Freeing a tensor's memory behind autograd, and giving it back: what FSDP does to a gathered
// parameter (`untyped_storage().resize_(0)`) between its uses. Lesson 07 frees each unit's
// gathered parameters after its forward and refills them for its backward; lesson 11 frees
// ZeRO-3's whole parameters between steps.
#pragma once

#include <torch/torch.h>

namespace dtc {

/// Releases the memory of @p t's storage and leaves the storage empty (0 bytes): every tensor
/// that views it, autograd's saved tensors included, keeps its shape, and must not be read until
/// refill_storage() gives the storage its bytes back. FSDP's `untyped_storage().resize_(0)`,
/// written with ATen's StorageImpl (the same on LibTorch 1.13 and 2.x).
void free_storage(const torch::Tensor& t);

/// Hands @p from's memory to @p into's emptied storage (no copy, no allocation, no version
/// counter bump, so autograd's saved views of @p into read the new bytes); @p from is left
/// empty. Both must be contiguous, start at offset 0 of their storage and have the same
/// dtype, device and number of elements, and @p into's storage must be empty (freed).
/// @throws std::invalid_argument when they do not match, or @p into still holds memory.
void refill_storage(const torch::Tensor& into, const torch::Tensor& from);

}  // namespace dtc
