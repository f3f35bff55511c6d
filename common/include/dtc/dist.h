// Process groups: connect to the store, create a communicator, build subgroups.
//
//   auto dist = dtc::init_distributed(dtc::read_launch_env(), {});
//   std::vector<at::Tensor> t{torch::ones({4})};
//   dist.comm->allreduce(t)->wait();   // every element is now world_size
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/csrc/autograd/custom_function.h>

#include "dtc/compat.h"
#include "dtc/launch.h"

namespace dtc {

/// Which collective library to use.
enum class BackendKind { kGloo, kNccl };

/// Parses "gloo" or "nccl". @throws UsageError otherwise (or for nccl without a CUDA build).
BackendKind parse_backend(const std::string& name);
/// "gloo" or "nccl": the --backend value of @p backend.
const char* backend_name(BackendKind backend);

/// Options for init_distributed().
struct DistOptions {
  BackendKind backend = BackendKind::kGloo;
  /// How long a collective or a store read may wait before it fails: a hang becomes an error.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
};

/// A rank's view of the job.
struct Distributed {
  LaunchEnv env;
  c10::intrusive_ptr<c10d::Store> store;  ///< scoped by env.store_prefix()
  c10::intrusive_ptr<Comm> comm;          ///< all ranks
  int rank() const { return comm->getRank(); }
  int size() const { return comm->getSize(); }
};

/// Connects to the job's TCPStore at MASTER_ADDR:MASTER_PORT. Rank 0 hosts it unless
/// torchrun's agent already does (TORCHELASTIC_USE_AGENT_STORE=True); keys are scoped by the
/// restart count, so an elastic restart never reads a failed attempt's keys.
c10::intrusive_ptr<c10d::Store> connect_store(const LaunchEnv& env,
                                              std::chrono::milliseconds timeout);

/// The gloo transport device: GLOO_SOCKET_IFNAME's interface when set, loopback when the store
/// is on this machine's loopback, else the address of this host's name.
std::shared_ptr<::gloo::transport::Device> make_gloo_device(const std::string& master_addr);

/// A communicator over @p store for @p size ranks.
c10::intrusive_ptr<Comm> new_comm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                  BackendKind backend, std::chrono::milliseconds timeout,
                                  const std::string& master_addr = "127.0.0.1");

/// The C++ counterpart of torch.distributed.new_group: a communicator over @p ranks (global
/// ranks, any order), built by its members only over PrefixStore("group/<name>/", store).
/// Each member's rank in the subgroup is its index in the sorted rank list.
/// @return the subgroup, or nullptr when @p global_rank is not a member.
/// @throws UsageError for an empty or duplicated rank list.
c10::intrusive_ptr<Comm> new_subgroup(const c10::intrusive_ptr<c10d::Store>& store,
                                      const std::string& name, std::vector<int> ranks,
                                      int global_rank, BackendKind backend,
                                      std::chrono::milliseconds timeout,
                                      const std::string& master_addr = "127.0.0.1");

/// How a communicator reaches an autograd function's forward and backward: as an int64 holding
/// its address (a forward argument, and ctx->saved_data["comm"]); backward may run later, and on
/// GPUs on another thread, so no global or thread_local. The caller keeps the communicator alive
/// until backward has run.
inline int64_t comm_handle(Comm& comm) {
  return static_cast<int64_t>(reinterpret_cast<intptr_t>(&comm));
}
/// The communicator of comm_handle(comm).
inline Comm& comm_from(int64_t handle) {
  return *reinterpret_cast<Comm*>(static_cast<intptr_t>(handle));
}
/// The communicator a forward stored for its backward: ctx->saved_data["comm"] = comm_handle(c).
inline Comm& comm_of(const torch::autograd::AutogradContext* ctx) {
  return comm_from(ctx->saved_data.at("comm").toInt());
}

/// One send or receive of a batch_isend_irecv().
struct P2POp {
  enum Kind { kSend, kRecv } kind = kSend;
  at::Tensor tensor;  ///< sent from, or received into (contiguous)
  int peer = -1;      ///< the other rank, in @p comm's numbering
  int tag = 0;        ///< matches a send with its receive between the same two ranks
};

/// Starts @p ops together and returns what to wait on, as torch.distributed.batch_isend_irecv
/// does. On a communicator that coalesces (NCCL) the ops form one group (ncclGroupStart/End), a
/// single op too: a send to rank q and a receive from q then progress together, and every group
/// runs on the communicator of the whole of @p comm. Send every point-to-point message of a
/// program this way. Issued one by one instead (comm.send, comm.recv), an NCCL send is
/// "blocking for the GPU" (NCCL's ncclSend reference) on a stream kept for its two ranks, so two
/// neighbours that each send before they receive wait on each other; and a lone op runs on a
/// communicator of its two ranks (c10d's lazy mode), so a message sent lone is never received
/// by a grouped receive, or the other way round. On gloo, which has no groups, the ops are
/// posted in order.
/// On NCCL the whole group's communicator is created by the group's first collective, with every
/// rank of @p comm taking part: run one collective over @p comm before the first batch
/// (torch.distributed.batch_isend_irecv's documentation asks the same).
/// @return the Works to wait on before the received tensors are read or the sent ones reused
std::vector<c10::intrusive_ptr<c10d::Work>> batch_isend_irecv(Comm& comm,
                                                              const std::vector<P2POp>& ops);

/// Connects to the store and creates the world communicator.
Distributed init_distributed(const LaunchEnv& env, const DistOptions& options);

}  // namespace dtc
