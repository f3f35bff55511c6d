// dtc/memory.h: the counting allocator's per-thread mark (mark_thread_cpu_memory).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>

#include "dtc/memory.h"

namespace dtc {
namespace {

// After a mark, only this thread's new storage counts: older storage freed meanwhile (here by
// another thread, as a collective's buffer released by a library thread) changes nothing, and
// new storage freed by another thread leaves the count.
TEST(CommonMemory, AMarkCountsOnlyTheNewStorageStillHeld) {
  install_counting_allocator();
  torch::Tensor old = torch::empty({1000});  // 4000 bytes before the mark
  mark_thread_cpu_memory();
  EXPECT_EQ(thread_cpu_memory_since_mark(), 0);
  torch::Tensor kept = torch::empty({250});    // 1000 bytes
  torch::Tensor passed = torch::empty({100});  // 400 bytes, freed by another thread below
  EXPECT_EQ(thread_cpu_memory_since_mark(), 1400);
  std::thread([o = std::move(old), p = std::move(passed)]() mutable {
    o = torch::Tensor();
    p = torch::Tensor();
  }).join();
  EXPECT_EQ(thread_cpu_memory_since_mark(), 1000) << "the old storage's free does not count";
  mark_thread_cpu_memory();
  EXPECT_EQ(thread_cpu_memory_since_mark(), 0) << "a new mark starts again";
  kept = torch::Tensor();
  EXPECT_EQ(thread_cpu_memory_since_mark(), 0) << "storage of the previous mark";
}

}  // namespace
}  // namespace dtc
