// Everything that differs between the two LibTorch generations the course supports, in one
// place. Lessons never test versions: they use what this header gives them.
//
//   LibTorch 1.13 (Debian's libtorch-dev, the light path): ProcessGroupGloo is a ProcessGroup.
//   LibTorch 2.x (PyPI's torch, GPU nodes):                 ProcessGroupGloo is a Backend.
//
// Both expose the same direct collective calls (allreduce, broadcast, allgather, alltoall_base,
// send, recv, barrier) with the same signatures, so the course talks to `dtc::Comm`.
//
// Training (lesson 02 on): the CPU allocator interface (CpuAllocatorBase: `allocate` is const
// before 2.3, 2.3 adds copy_data), setting gradients to none (zero_grad_to_none: 1.13's
// zero_grad() only zeroes), and the optimizer's state map (optimizer_state: keyed by a
// TensorImpl* in 2.x, by its string in 1.13), a parameter's gradient accumulator
// (GradAccumulator: a shared_ptr in 1.13, an intrusive_ptr in 2.x).
#pragma once

#include <torch/torch.h>
#include <torch/version.h>

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#if defined(DTC_HAVE_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

// PyTorch's Flight Recorder, generic over backends and recording gloo's collectives too, from
// 2.8 (pytorch/pytorch#152614); 1.13 has it for NCCL only, with no C++ dump call for gloo.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>
#define DTC_HAVE_FLIGHT_RECORDER 1
#endif

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dtc {

#if TORCH_VERSION_MAJOR >= 2
/// A communicator: one backend instance over a fixed set of ranks.
using Comm = c10d::Backend;
#else
/// A communicator: one backend instance over a fixed set of ranks.
using Comm = c10d::ProcessGroup;
#endif

/// True when this LibTorch was built with NCCL (a CUDA build) and the course was compiled
/// against it.
#if defined(DTC_HAVE_NCCL)
inline constexpr bool kHaveNccl = true;
#else
inline constexpr bool kHaveNccl = false;
#endif

/// The LibTorch version this program was compiled against, e.g. "2.15.0".
inline std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

/// The LibTorch generation: 1 (Debian's 1.13) or 2 (PyPI's 2.x, which wrote the course's PyTorch
/// reference values: a test may hold 1.13 to a wider tolerance where kernels differ).
inline constexpr int kTorchMajor = TORCH_VERSION_MAJOR;

/// Whether this LibTorch can train the course's GPT in fp16 on the CPU. 1.13 has no CPU fp16
/// LayerNorm ("LayerNormKernelImpl" not implemented for 'Half'); 2.15 has every op the model
/// needs. (bf16 works on both.)
inline constexpr bool kCpuFp16Training = TORCH_VERSION_MAJOR >= 2;

/// Whether gloo allreduces bf16 tensors: 2.x does; 1.13's gloo backend rejects them ("Invalid
/// scalar type"). fp16 works on both. Lesson 06's compression hook needs it.
inline constexpr bool kGlooBf16 = TORCH_VERSION_MAJOR >= 2;

/// Whether this LibTorch records gloo's collectives in the Flight Recorder (2.8 on).
#if defined(DTC_HAVE_FLIGHT_RECORDER)
inline constexpr bool kHaveFlightRecorder = true;
#else
inline constexpr bool kHaveFlightRecorder = false;
#endif

/// This process's Flight Recorder trace as JSON (c10d::dump_fr_trace_json: the recorded
/// collectives of every group in the process, and each group's last enqueued and completed
/// sequence numbers, "pg_status"); std::nullopt where LibTorch has no Flight Recorder for gloo.
inline std::optional<std::string> flight_recorder_json() {
#if defined(DTC_HAVE_FLIGHT_RECORDER)
  return c10d::dump_fr_trace_json(/*includeCollectives=*/true, /*onlyActive=*/false);
#else
  return std::nullopt;
#endif
}

/// A gloo communicator; @p device is from make_gloo_device().
inline c10::intrusive_ptr<Comm> new_gloo_comm(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    const std::shared_ptr<::gloo::transport::Device>& device, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(device);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

#if defined(DTC_HAVE_NCCL)
#if TORCH_VERSION_MAJOR >= 2
/// ProcessGroupNCCL, ended with abort() when its last holder lets go. That is what its own
/// destructor does too, after warning "destroy_process_group() was not called before program
/// exit": a warning about Python's global process group that a C++ program, which has none, got
/// on every NCCL run (seen with torch 2.11 on a GPU). abort() does not flush: every course program
/// waits on each Work before it lets its communicators go.
class NcclComm final : public c10d::ProcessGroupNCCL {
 public:
  using c10d::ProcessGroupNCCL::ProcessGroupNCCL;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  ~NcclComm() override {
    try {
      abort();
    } catch (...) {  // a destructor must not throw; the base destructor aborts again if needed
    }
  }
};
#else
using NcclComm = c10d::ProcessGroupNCCL;
#endif

/// An NCCL communicator over the current CUDA device.
inline c10::intrusive_ptr<Comm> new_nccl_comm(const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int size,
                                              std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<NcclComm>(store, rank, size, options);
}
#endif

// ---------------------------------------------------------------------------------------------
// Grouped point-to-point (lesson 09: dtc::batch_isend_irecv)
// ---------------------------------------------------------------------------------------------

/// Whether a batch of operations on @p comm can be bracketed by comm.startCoalescing() (the same
/// call on both generations) and end_coalescing(). 2.x asks the backend (gloo's would throw; NCCL
/// runs the group as one
/// launch, ncclGroupStart/End); on 1.13 always, as the base class's pair does nothing.
inline bool coalesces(Comm& comm) {
#if TORCH_VERSION_MAJOR >= 2
  return comm.supportsCoalescing();
#else
  (void)comm;
  return true;
#endif
}

/// Closes the group opened by comm.startCoalescing(). @p works are the Works its operations
/// returned (1.13 records its completion events on them). @return 2.x: one Work for the whole
/// group, or null; 1.13: null (wait on @p works).
inline c10::intrusive_ptr<c10d::Work> end_coalescing(
    Comm& comm, std::vector<c10::intrusive_ptr<c10d::Work>>& works) {
#if TORCH_VERSION_MAJOR >= 2
  (void)works;
  return comm.endCoalescing();
#else
  comm.endCoalescing(works);
  return {};  // null
#endif
}

// ---------------------------------------------------------------------------------------------
// Memory and optimizers (lesson 02 on)
// ---------------------------------------------------------------------------------------------

// LibTorch's CPU allocator interface changed in 2.3: `allocate` lost its `const`, and a pure
// virtual `copy_data` was added. Before 2.3 (1.13 here) `allocate` is const and there is no
// copy_data. (1.13 verified on the light path; 2.15 on the primary path.)
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define DTC_ALLOCATOR_2_3 1
#endif

/// A CPU allocator with one interface on every LibTorch: derive from it and implement
/// allocate_bytes(); it becomes `allocate` (const or not, as this LibTorch declares it), and
/// copy_data, where LibTorch asks for it, is a memcpy.
class CpuAllocatorBase : public c10::Allocator {
 public:
#if defined(DTC_ALLOCATOR_2_3)
  c10::DataPtr allocate(size_t n) override { return allocate_bytes(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#else
  c10::DataPtr allocate(size_t n) const override { return allocate_bytes(n); }
#endif

 protected:
  /// Allocates @p n bytes on the CPU.
  virtual c10::DataPtr allocate_bytes(size_t n) const = 0;
};

/// Sets every gradient of @p optimizer's parameters to none (undefined), so that its memory is
/// freed until the next backward writes a fresh one. 2.x: `zero_grad()` does this by default
/// (set_to_none = true); 1.13's `zero_grad()` has no such flag and only fills them with zeros,
/// keeping the memory.
inline void zero_grad_to_none(torch::optim::Optimizer& optimizer) {
#if TORCH_VERSION_MAJOR >= 2
  optimizer.zero_grad(/*set_to_none=*/true);
#else
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) p.mutable_grad().reset();
  }
#endif
}

/// The node that adds a leaf's gradients into its grad() (AccumulateGrad): hooks added to it
/// with add_post_hook run once the gradient is in grad(). A leaf refers to its accumulator only
/// weakly, so whoever hooks it holds this pointer for as long as the hook should run.
using GradAccumulator =
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const torch::Tensor&>()));

/// @p leaf's gradient accumulator (made now if the leaf has none yet).
inline GradAccumulator grad_accumulator(const torch::Tensor& leaf) {
  return torch::autograd::impl::grad_accumulator(leaf);
}

/// Megatron's main_grad: each time backward has written @p leaf's grad(), @p take receives it
/// (to add into a wider buffer) and the grad is freed at once, so that only what @p take keeps
/// outlives backward. Returns the hooked accumulator: hold it for as long as the hook should run.
inline GradAccumulator take_each_gradient(const torch::Tensor& leaf,
                                          std::function<void(const torch::Tensor&)> take) {
  struct Take : torch::autograd::FunctionPostHook {
    Take(torch::Tensor l, std::function<void(const torch::Tensor&)> f)
        : leaf(std::move(l)), take(std::move(f)) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                              const torch::autograd::variable_list&) override {
      torch::NoGradGuard no_grad;
      auto& g = leaf.mutable_grad();
      if (g.defined()) {
        take(g);
        g.reset();
      }
      return outputs;
    }
    torch::Tensor leaf;
    std::function<void(const torch::Tensor&)> take;
  };
  GradAccumulator accumulator = grad_accumulator(leaf);
  accumulator->add_post_hook(std::make_unique<Take>(leaf, std::move(take)));
  return accumulator;
}

/// The key of parameter @p param in Optimizer::state(): its TensorImpl pointer in 2.x, and that
/// pointer printed as a string in 1.13.
inline auto optimizer_state_key(const torch::Tensor& param) {
#if TORCH_VERSION_MAJOR >= 2
  return static_cast<void*>(param.unsafeGetTensorImpl());
#else
  return c10::guts::to_string(param.unsafeGetTensorImpl());
#endif
}

/// The optimizer state of parameter @p param (e.g. a torch::optim::AdamWParamState), or nullptr
/// before its first step.
inline torch::optim::OptimizerParamState* optimizer_state(torch::optim::Optimizer& optimizer,
                                                          const torch::Tensor& param) {
  auto it = optimizer.state().find(optimizer_state_key(param));
  return it == optimizer.state().end() ? nullptr : it->second.get();
}

/// Makes @p state the optimizer state of parameter @p param (replacing any), keyed as
/// optimizer_state() finds it; returns it.
inline torch::optim::OptimizerParamState* set_optimizer_state(
    torch::optim::Optimizer& optimizer, const torch::Tensor& param,
    std::unique_ptr<torch::optim::OptimizerParamState> state) {
  auto& slot = optimizer.state()[optimizer_state_key(param)];
  slot = std::move(state);
  return slot.get();
}

/// A TCPStore client (or server, when @p is_server) at host:port.
inline c10::intrusive_ptr<c10d::Store> new_tcp_store(const std::string& host, int port,
                                                     bool is_server, int world_size,
                                                     std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = is_server;
  opts.numWorkers = static_cast<size_t>(world_size);
  opts.waitWorkers = false;
  opts.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(host, opts);
}

/// The port a TCPStore really listens on (useful after asking for port 0).
inline int tcp_store_port(const c10::intrusive_ptr<c10d::Store>& store) {
  auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get());
  TORCH_CHECK(tcp != nullptr, "tcp_store_port: not a TCPStore");
  return tcp->getPort();
}

}  // namespace dtc

// =============================================================================================
// GPU: CUDA devices and memory statistics (added by lesson 05)
// =============================================================================================
// A CUDA build of LibTorch (PyPI's wheel, a GPU node's PyTorch) has c10/cuda and the CUDA
// runtime headers; Debian's 1.13 (the light path) has neither. DTC_HAVE_CUDA marks the first.
// Everything below compiles on both paths: without CUDA it reports no devices and zero bytes.
// On a CPU-only machine a CUDA build also reports no devices (torch::cuda::device_count() == 0).
#if defined(DTC_HAVE_NCCL) && __has_include(<c10/cuda/CUDACachingAllocator.h>) && \
    __has_include(<cuda_runtime_api.h>)
#define DTC_HAVE_CUDA 1
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

#include <cstdint>
#include <stdexcept>

namespace dtc {

/// True when this LibTorch is a CUDA build (it may still see no GPU).
#if defined(DTC_HAVE_CUDA)
inline constexpr bool kHaveCuda = true;
#else
inline constexpr bool kHaveCuda = false;
#endif

/// How many CUDA devices this process sees (after CUDA_VISIBLE_DEVICES); 0 without CUDA.
inline int cuda_device_count() {
  return kHaveCuda ? static_cast<int>(torch::cuda::device_count()) : 0;
}

/// The device of the rank with local rank @p local_rank: cuda:<local_rank>, made the current
/// device (so that NCCL and new tensors use it), when CUDA devices are visible; else the CPU.
/// @throws std::runtime_error when local_rank >= the number of visible devices (more ranks per
///   node than GPUs: check --nproc_per_node and CUDA_VISIBLE_DEVICES).
inline torch::Device cuda_device_for_local_rank(int local_rank) {
  const int n = cuda_device_count();
  if (n == 0) return torch::Device(torch::kCPU);
  if (local_rank < 0 || local_rank >= n) {
    throw std::runtime_error("LOCAL_RANK " + std::to_string(local_rank) + " has no GPU: this " +
                             "process sees " + std::to_string(n) + " device(s)\nHINT: run at " +
                             "most one rank per GPU (--nproc_per_node <= " + std::to_string(n) +
                             "), and check CUDA_VISIBLE_DEVICES");
  }
#if defined(DTC_HAVE_CUDA)
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(local_rank));
#endif
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

/// Makes @p device the calling thread's current CUDA device (NCCL's communicators, new
/// tensors, the current stream and CUDA events use it); nothing for a CPU device.
inline void make_current_device(const torch::Device& device) {
#if defined(DTC_HAVE_CUDA)
  if (device.is_cuda()) c10::cuda::set_device(device.index());
#else
  (void)device;
#endif
}

/// The CUDA device's name ("NVIDIA H100 80GB HBM3"), or "" without CUDA.
inline std::string cuda_device_name(int device) {
#if defined(DTC_HAVE_CUDA)
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) return prop.name;
#endif
  (void)device;
  return "";
}

/// Bytes held by the CUDA caching allocator on one device (current and peak since the last
/// reset_cuda_peak_memory()); all zero without CUDA.
struct CudaMemoryStats {
  int64_t allocated = 0;       ///< bytes in live tensors
  int64_t peak_allocated = 0;  ///< the most bytes in live tensors at once
  int64_t reserved = 0;        ///< bytes the allocator holds from the driver (cached included)
  int64_t peak_reserved = 0;
};

#if defined(DTC_HAVE_CUDA)
/// Initialises CUDA (and with it the caching allocator) the way the first CUDA tensor does. The
/// allocator's statistics refuse a device before that ("Invalid device argument ...: did you
/// call init?", seen on torch 2.11 when a program measures before its first CUDA tensor). An
/// empty tensor allocates nothing, so the statistics do not move.
inline void init_cuda_allocator(int device) {
  (void)torch::empty(
      {0}, torch::TensorOptions().device(torch::kCUDA, static_cast<c10::DeviceIndex>(device)));
}
#endif

/// The caching allocator's statistics for @p device (index 0 of each StatArray: the aggregate
/// over small and large pools; the same layout in 1.13 and 2.x).
inline CudaMemoryStats cuda_memory_stats(int device) {
  CudaMemoryStats out;
#if defined(DTC_HAVE_CUDA)
  if (cuda_device_count() == 0) return out;
  init_cuda_allocator(device);
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  out.allocated = stats.allocated_bytes[0].current;
  out.peak_allocated = stats.allocated_bytes[0].peak;
  out.reserved = stats.reserved_bytes[0].current;
  out.peak_reserved = stats.reserved_bytes[0].peak;
#endif
  (void)device;
  return out;
}

/// Starts a new peak for cuda_memory_stats(); does nothing without CUDA.
inline void reset_cuda_peak_memory(int device) {
#if defined(DTC_HAVE_CUDA)
  if (cuda_device_count() > 0) {
    init_cuda_allocator(device);
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
  }
#endif
  (void)device;
}

}  // namespace dtc
