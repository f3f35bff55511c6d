// The communicator of thread-ranks: the ranks of dtc::run_ranks are threads of one process, and
// their collectives move tensors in memory instead of through gloo's sockets. PyTorch's own
// thread-rank tests do the same (torch/testing/_internal/distributed/multi_threaded_pg.py,
// ProcessLocalGroup, behind MultiThreadedTestCase).
//
// What a learner's code sees is gloo's behaviour, call for call:
//   - every call returns at once with a Work; the data moves when the last rank of the group has
//     issued the call, and wait() blocks until then (or fails after the communicator's timeout,
//     naming the ranks that never issued it);
//   - collectives match by their order on each rank, point-to-point messages by (peer, tag) in
//     the order they were posted, and a send completes only once its receive is posted (gloo's
//     send waits for the receiver's "ready" as well);
//   - sums run in the tensors' own dtype, rank 0 first (bf16 rounds at every step, as gloo's do);
//   - ReduceOp::AVG is refused, as gloo refuses it;
//   - barrier() completes after this rank's earlier calls on the communicator have.
// Calls that do not match (another collective at the same place, other sizes or dtypes) fail on
// every rank with a message that says which rank called what. No tensor is allocated to move
// the data: the counting allocator sees the same bytes per rank as with gloo.
//
// getBackendName() is "local". Set DTC_RANKS_TRANSPORT=gloo to run every thread-rank test over
// gloo instead (a check that both agree; e2e runs and programs always use gloo or NCCL).
#pragma once

#include <chrono>

#include "dtc/compat.h"

namespace dtc {

/// A communicator over @p store for @p size thread-ranks of this process. Every member calls it
/// with the same store (or PrefixStore over it) and the same @p size, in the same order as its
/// other communicators over that store.
c10::intrusive_ptr<Comm> new_local_comm(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                        int size, std::chrono::milliseconds timeout);

/// Whether new_comm() gives this thread local communicators for BackendKind::kGloo: set by
/// run_ranks on its threads (unless DTC_RANKS_TRANSPORT=gloo).
bool& local_transport_on_this_thread();

}  // namespace dtc
