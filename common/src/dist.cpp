#include "dtc/dist.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "dtc/errors.h"
#include "dtc/local_comm.h"

namespace dtc {
namespace {

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

}  // namespace

const char* backend_name(BackendKind backend) {
  return backend == BackendKind::kNccl ? "nccl" : "gloo";
}

BackendKind parse_backend(const std::string& name) {
  if (name == "gloo") return BackendKind::kGloo;
  if (name == "nccl") {
    if (!kHaveNccl) {
      throw UsageError("--backend", "nccl is not available: this build's LibTorch has no NCCL",
                       "use --backend gloo, or build against a CUDA LibTorch on a GPU node "
                       "(see the README, 'GPU nodes')");
    }
    return BackendKind::kNccl;
  }
  throw UsageError("--backend", "'" + name + "' is not a backend", "use gloo or nccl");
}

c10::intrusive_ptr<c10d::Store> connect_store(const LaunchEnv& env,
                                              std::chrono::milliseconds timeout) {
  // A torchrun of the other LibTorch generation: say so now, not after a store timeout.
  if (env.use_agent_store) check_torchrun_generation(TORCH_VERSION_MAJOR, DTC_TORCHRUN_CMD);
  c10::intrusive_ptr<c10d::Store> store;
  const auto fail = [&](const std::string& what) {
    return std::runtime_error(fmt::format(
        "cannot {} the store at {}:{}: {}\nHINT: {}", env.hosts_store() ? "host" : "reach",
        env.master_addr, env.master_port, what,
        env.hosts_store()     ? "the port may be in use: choose another MASTER_PORT (--master_port)"
        : env.use_agent_store ? "is this the torchrun of this build? " DTC_TORCHRUN_CMD
                                " (LibTorch 1.x and 2.x stores do not talk to each other)"
                              : "check that rank 0 is running and MASTER_ADDR resolves to it"));
  };
  try {
    store =
        new_tcp_store(env.master_addr, env.master_port, env.hosts_store(), env.world_size, timeout);
  } catch (const c10::Error& e) {
    throw fail(e.what_without_backtrace());  // a user's mistake: no LibTorch stack trace
  } catch (const std::exception& e) {
    throw fail(e.what());
  }
  return c10::make_intrusive<c10d::PrefixStore>(env.store_prefix(), store);
}

std::shared_ptr<::gloo::transport::Device> make_gloo_device(const std::string& master_addr) {
  // One device per process and address, shared by every communicator: each device is a
  // listening socket and an event-loop thread, and gloo's pairs find their peer's context on
  // it by a sequence number, so communicators (and thread-ranks) need not have one each.
  // (never destroyed: a device's thread must not be joined while the process exits)
  static std::mutex mu;
  static auto* devices = new std::map<std::string, std::shared_ptr<::gloo::transport::Device>>();
  const auto ifname = process_env("GLOO_SOCKET_IFNAME");
  const bool loopback = !ifname && is_loopback(master_addr);
  const std::string key = ifname ? "if:" + *ifname : loopback ? "loopback" : "default";
  std::lock_guard<std::mutex> lock(mu);
  auto& device = (*devices)[key];
  if (device) return device;
  if (ifname) {
    try {
      device = c10d::ProcessGroupGloo::createDeviceForInterface(*ifname);
    } catch (const std::exception& e) {
      throw UsageError("GLOO_SOCKET_IFNAME",
                       fmt::format("cannot use interface '{}': {}", *ifname, e.what()),
                       "list the interfaces with `ip -brief addr` and pick one that is UP");
    }
  } else {
    device = loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                      : c10d::ProcessGroupGloo::createDefaultDevice();
  }
  return device;
}

c10::intrusive_ptr<Comm> new_comm(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                  BackendKind backend, std::chrono::milliseconds timeout,
                                  const std::string& master_addr) {
  if (backend == BackendKind::kNccl) {
#if defined(DTC_HAVE_NCCL)
    return new_nccl_comm(store, rank, size, timeout);
#else
    parse_backend("nccl");  // throws the explanation
#endif
  }
  if (local_transport_on_this_thread()) return new_local_comm(store, rank, size, timeout);
  return new_gloo_comm(store, rank, size, make_gloo_device(master_addr), timeout);
}

c10::intrusive_ptr<Comm> new_subgroup(const c10::intrusive_ptr<c10d::Store>& store,
                                      const std::string& name, std::vector<int> ranks,
                                      int global_rank, BackendKind backend,
                                      std::chrono::milliseconds timeout,
                                      const std::string& master_addr) {
  if (ranks.empty()) {
    throw UsageError("new_subgroup(" + name + ")", "the rank list is empty",
                     "pass the global ranks of the group's members");
  }
  std::sort(ranks.begin(), ranks.end());
  if (std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end()) {
    throw UsageError("new_subgroup(" + name + ")", "a rank is listed twice",
                     "list each member once");
  }
  auto it = std::find(ranks.begin(), ranks.end(), global_rank);
  if (it == ranks.end()) return c10::intrusive_ptr<Comm>();  // not a member
  const int sub_rank = static_cast<int>(it - ranks.begin());
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("group/" + name + "/", store);
  return new_comm(prefixed, sub_rank, static_cast<int>(ranks.size()), backend, timeout,
                  master_addr);
}

std::vector<c10::intrusive_ptr<c10d::Work>> batch_isend_irecv(Comm& comm,
                                                              const std::vector<P2POp>& ops) {
  // Even one op is a group: on NCCL a lone send or receive runs on a communicator of its two
  // ranks, a group on the communicator of the whole of comm, and a message sent on one is never
  // received on the other. One way for every op keeps them all on the same communicator.
  const bool group = !ops.empty() && coalesces(comm);
  if (group) comm.startCoalescing();
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (const P2POp& op : ops) {
    std::vector<at::Tensor> tensors{op.tensor};
    auto work = op.kind == P2POp::kSend ? comm.send(tensors, op.peer, op.tag)
                                        : comm.recv(tensors, op.peer, op.tag);
    if (work) works.push_back(work);
  }
  if (group) {
    // 2.x: one Work for the group, and only it is waited on, as PyTorch's _coalescing_manager
    // does (an op inside an NCCL group has no Work of its own to wait for); 1.13: the ops' own.
    auto all = end_coalescing(comm, works);
    if (all) return {all};
  }
  return works;
}

Distributed init_distributed(const LaunchEnv& env, const DistOptions& options) {
  Distributed d;
  d.env = env;
  d.store = connect_store(env, options.timeout);
  d.comm = new_comm(d.store, env.rank, env.world_size, options.backend, options.timeout,
                    env.master_addr);
  return d;
}

}  // namespace dtc
