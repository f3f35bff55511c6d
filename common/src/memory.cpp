// The counting CPU allocator (see dtc/memory.h).
#include "dtc/memory.h"

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

#include "dtc/compat.h"

namespace dtc {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_allocations{0};
std::atomic<bool> g_installed{false};

// The counters of the thread that made an allocation (a rank, in thread-rank tests). Leaked:
// an allocation may be freed after its thread has ended.
struct ThreadCounters {
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> allocations{0};
  std::atomic<int64_t> mark{0};        // mark_thread_cpu_memory()'s count of calls
  std::atomic<int64_t> since_mark{0};  // bytes allocated under the current mark, not freed
};
ThreadCounters* this_thread_counters() {
  thread_local ThreadCounters* counters = new ThreadCounters();
  return counters;
}

void raise_peak(std::atomic<int64_t>& peak, int64_t now) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

struct Live {
  int64_t bytes = 0;
  ThreadCounters* owner = nullptr;
  int64_t mark = 0;  // the owner's mark when it was allocated
};

// The size of every live counted allocation, by address. LibTorch's raw interface
// (raw_allocate, used by some kernels for scratch buffers) requires a DataPtr's context to be
// its data pointer, so the size cannot ride in the context: it is looked up here on free.
std::mutex g_mutex;
std::unordered_map<void*, Live>* g_sizes = nullptr;  // leaked: frees may come at exit
c10::DeleterFnPtr g_inner_deleter = nullptr;         // the wrapped allocator's deleter

void count_free(void* data) {
  Live live;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_sizes->find(data);
    if (it != g_sizes->end()) {
      live = it->second;
      g_sizes->erase(it);
    }
  }
  g_current.fetch_sub(live.bytes, std::memory_order_relaxed);
  if (live.owner != nullptr) {
    live.owner->current.fetch_sub(live.bytes, std::memory_order_relaxed);
    if (live.mark > 0 && live.mark == live.owner->mark.load(std::memory_order_relaxed)) {
      live.owner->since_mark.fetch_sub(live.bytes, std::memory_order_relaxed);
    }
  }
  g_inner_deleter(data);
}

// Wraps the CPU allocator that was installed before it (LibTorch's default, whose DataPtrs
// have context == data and one raw deleter).
class CountingAllocator final : public CpuAllocatorBase {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DeleterFnPtr raw_deleter() const override { return &count_free; }

 protected:
  c10::DataPtr allocate_bytes(size_t n) const override {
    c10::DataPtr inner = inner_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // 0 bytes: nothing to count, nothing to free
    TORCH_CHECK(inner.get_context() == data && inner.get_deleter() == g_inner_deleter,
                "dtc counting allocator: the wrapped CPU allocator is not a simple one");
    const c10::Device device = inner.device();
    inner.release_context();  // ours now: count_free hands it back to g_inner_deleter
    const auto bytes = static_cast<int64_t>(n);
    ThreadCounters* mine = this_thread_counters();
    const int64_t mark = mine->mark.load(std::memory_order_relaxed);
    if (mark > 0) mine->since_mark.fetch_add(bytes, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      (*g_sizes)[data] = Live{bytes, mine, mark};
    }
    raise_peak(g_peak, g_current.fetch_add(bytes, std::memory_order_relaxed) + bytes);
    g_allocations.fetch_add(1, std::memory_order_relaxed);
    raise_peak(mine->peak, mine->current.fetch_add(bytes, std::memory_order_relaxed) + bytes);
    mine->allocations.fetch_add(1, std::memory_order_relaxed);
    return {data, data, &count_free, device};
  }

 private:
  c10::Allocator* inner_;
};

}  // namespace

void install_counting_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::Allocator* inner = c10::GetCPUAllocator();
    g_inner_deleter = inner->raw_deleter();
    TORCH_CHECK(g_inner_deleter != nullptr,
                "dtc counting allocator: the CPU allocator has no raw deleter to wrap");
    g_sizes = new std::unordered_map<void*, Live>();
    // Leaked on purpose: tensors freed during static destruction still call its deleter.
    static auto* counting = new CountingAllocator(inner);
    // Priority 0 replaces the default allocator, which LibTorch registers with priority 0.
    c10::SetCPUAllocator(counting, /*priority=*/0);
    g_installed = true;
  });
}

bool counting_allocator_installed() { return g_installed.load(); }

MemoryCounters cpu_memory() { return {g_current.load(), g_peak.load(), g_allocations.load()}; }

void reset_cpu_peak() { g_peak.store(g_current.load()); }

MemoryCounters thread_cpu_memory() {
  ThreadCounters* mine = this_thread_counters();
  return {mine->current.load(), mine->peak.load(), mine->allocations.load()};
}

void reset_thread_cpu_peak() {
  ThreadCounters* mine = this_thread_counters();
  mine->peak.store(mine->current.load());
}

void mark_thread_cpu_memory() {
  // The new mark first: a free of older storage (another thread's, any moment) no longer counts.
  ThreadCounters* mine = this_thread_counters();
  mine->mark.fetch_add(1);
  mine->since_mark.store(0);
}

int64_t thread_cpu_memory_since_mark() { return this_thread_counters()->since_mark.load(); }

}  // namespace dtc
