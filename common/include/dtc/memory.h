// Measuring memory: a counting CPU allocator, so that a program can say exactly how many bytes
// its parameters, gradients, optimizer states and activations take, and compare them with the
// ledger of lesson 01.
//
// install_counting_allocator() puts a thin wrapper around LibTorch's CPU allocator
// (c10::SetCPUAllocator): every CPU tensor's storage is then counted when it is allocated and
// when it is freed. Counts are bytes requested by LibTorch (the allocator's own alignment and
// bookkeeping are not included), process-wide, over all threads, and per thread (the thread
// that allocated: thread_cpu_memory()).
//
//   dtc::install_counting_allocator();
//   const auto before = dtc::cpu_memory();
//   auto t = torch::empty({1000});                    // cpu_memory().current: +4000 bytes
//
// On a GPU, LibTorch's CUDA caching allocator keeps its own statistics
// (c10::cuda::CUDACachingAllocator::getDeviceStats); the course measures the CPU.
#pragma once

#include <cstdint>

namespace dtc {

/// Bytes of CPU tensor storage, as the counting allocator sees them.
struct MemoryCounters {
  int64_t current = 0;      ///< bytes allocated and not yet freed
  int64_t peak = 0;         ///< the highest `current` since install or the last reset_peak()
  int64_t allocations = 0;  ///< allocations since install
};

/// Installs the counting allocator as LibTorch's CPU allocator. Idempotent and thread-safe; it
/// stays installed for the life of the process. Storage allocated before it was installed is
/// not counted (neither when allocated nor when freed).
void install_counting_allocator();

/// True once install_counting_allocator() has run.
bool counting_allocator_installed();

/// The counters now (all zero before install).
MemoryCounters cpu_memory();

/// Sets the peak to the current value, to measure the peak of what follows.
void reset_cpu_peak();

/// The counters of the storage this thread allocated (whichever thread frees it): one rank's
/// own memory when ranks are threads (dtc::run_ranks), with one intra-op thread (a tensor that
/// an intra-op worker allocates counts for that worker).
MemoryCounters thread_cpu_memory();
/// Sets this thread's peak to its current value.
void reset_thread_cpu_peak();

/// Starts a count of this thread's new storage: thread_cpu_memory_since_mark() is then the bytes
/// this thread allocated after the call and has not freed yet. Storage allocated before does not
/// count, even when it is freed meanwhile (a collective's buffer that a library thread releases a
/// moment later): what a piece of code keeps, whatever finishes around it.
void mark_thread_cpu_memory();
/// See mark_thread_cpu_memory(); 0 before the first mark.
int64_t thread_cpu_memory_since_mark();

}  // namespace dtc
