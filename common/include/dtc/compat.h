// Everything that differs between the two LibTorch generations the course supports, in one
// place. Lessons never test versions: they use what this header gives them.
//
//   LibTorch 1.13 (Debian's libtorch-dev, the light path): ProcessGroupGloo is a ProcessGroup.
//   LibTorch 2.x (PyPI's torch, GPU nodes):                 ProcessGroupGloo is a Backend.
//
// Both expose the same direct collective calls (allreduce, broadcast, allgather, alltoall_base,
// send, recv, barrier) with the same signatures, so the course talks to `dtc::Comm`.
#pragma once

#include <torch/torch.h>
#include <torch/version.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#if defined(DTC_HAVE_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <string>

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

/// A gloo communicator; @p device is from make_gloo_device().
inline c10::intrusive_ptr<Comm> new_gloo_comm(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    const std::shared_ptr<::gloo::transport::Device>& device, std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(device);
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

#if defined(DTC_HAVE_NCCL)
/// An NCCL communicator over the current CUDA device.
inline c10::intrusive_ptr<Comm> new_nccl_comm(const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int size,
                                              std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}
#endif

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
