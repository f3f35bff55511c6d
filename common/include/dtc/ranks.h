// Run N ranks as threads in one process, over one shared HashStore (as PyTorch's own c10d tests
// do). Used by the tests of every multi-rank lesson. Their communicators move tensors in memory
// (dtc/local_comm.h: gloo's behaviour without its sockets, several times cheaper on a small
// machine); RanksTransport::kGloo, or DTC_RANKS_TRANSPORT=gloo for every run, uses gloo itself.
//
//   dtc::run_ranks(3, [](dtc::RankContext& ctx) {
//     std::vector<at::Tensor> t{torch::full({4}, float(ctx.rank))};
//     ctx.comm->allreduce(t)->wait();          // 0 + 1 + 2 = 3 everywhere
//   });
//
// A hang is a failure, never a stuck test: every collective times out after `timeout`, and a
// rank that is still running well after that stops the whole process with a message.
#pragma once

#include <chrono>
#include <functional>

#include "dtc/compat.h"

namespace dtc {

/// What one thread-rank gets.
struct RankContext {
  int rank = 0;
  int world = 1;
  c10::intrusive_ptr<c10d::Store> store;  ///< shared by all ranks of this run
  c10::intrusive_ptr<Comm> comm;          ///< local (or gloo over loopback): see RanksTransport
};

/// How thread-ranks talk. kLocal: every communicator the rank threads build with
/// BackendKind::kGloo (the world's, subgroups, a mesh's groups) is a local one (dtc/local_comm.h);
/// kGloo: gloo over loopback, for tests of gloo itself (its names, its flight recorder).
enum class RanksTransport { kLocal, kGloo };

/// Runs @p body on @p world thread-ranks and waits for all of them.
/// @throws std::runtime_error listing every rank that threw, with its message (e.g.
///   "rank 1 of 2 failed: Timed out waiting 1000ms for recv operation"; LibTorch's errors
///   without their backtrace).
/// If a rank has not returned 2 x timeout + min(5 x timeout, 10 s) after another rank returned (or,
/// while none has, 10 x timeout + 60 s after the start: a busy machine is not a hang), prints which
/// ranks are stuck and exits the process with code 124, so that the test fails instead of hanging.
/// Whether DTC_RANKS_TRANSPORT=gloo is set: every run_ranks then uses gloo, whatever it was asked.
bool ranks_forced_to_gloo();

/// DTC_RANKS_TRANSPORT=gloo in the environment makes every run gloo's.
void run_ranks(int world, const std::function<void(RankContext&)>& body,
               std::chrono::milliseconds timeout = std::chrono::seconds(10),
               RanksTransport transport = RanksTransport::kLocal);

}  // namespace dtc
