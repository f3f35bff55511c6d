// Observers for tests: what a learner's code did, seen from outside it, so that no test reads a
// number the learner's own code writes (a counter, a byte count, "in flight").
//
//   RecordingComm  wraps any Comm (gloo or NCCL) and records every call made through it: the
//                  operation, this rank's bytes, the peer or root, and its place in the order of
//                  events, which the test can interleave with its own marks (an autograd hook
//                  firing, a step starting). Each Work it returns records its wait() too (op
//                  "wait", label the call's op, id the call's seq): whether a rank waited for a
//                  send before posting the matching receive is visible. A group of operations
//                  (start/endCoalescing, dtc::batch_isend_irecv) shows as "group_start" and
//                  "group_end" events around them, also on gloo, which has no groups itself.
#pragma once

#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dtc/compat.h"

namespace dtc {

/// One call seen by a RecordingComm, or one mark() of the test's.
struct CommEvent {
  std::string op;     ///< "allreduce", "broadcast", "reduce", "allgather", "reduce_scatter",
                      ///< "alltoall", "send", "recv", "barrier", "group_start", "group_end",
                      ///< or "mark"
  std::string label;  ///< mark(): the test's label; empty otherwise
  int64_t bytes = 0;  ///< this rank's input bytes (recv: the bytes received; allgather: sent)
  int peer = -1;      ///< send/recv: the other rank; broadcast/reduce: the root; else -1
  int tag = -1;       ///< send/recv: the tag; else -1
  int64_t seq = 0;    ///< position among this RecordingComm's events, from 0
  int64_t id = -1;    ///< wait: the seq of the call whose Work was waited on
  /// The bytes of CPU storage the calling thread had allocated and not freed at the call
  /// (dtc::thread_cpu_memory().current), or -1 without the counting allocator: what a rank
  /// holds at each collective, e.g. whether a gathered unit was released before the next.
  int64_t thread_bytes = -1;
  /// alltoall: the bytes this rank sends to each rank of the group, itself included (its input's
  /// split sizes times a row's bytes; even splits when none were given); empty otherwise.
  std::vector<int64_t> sent_to;
  std::thread::id thread;                   ///< the thread that made the call
  std::chrono::steady_clock::time_point t;  ///< when the call was made (not when it finished)
};

/// A Comm that forwards every operation to @p inner, each through call(), which a subclass
/// overrides to see it: the base of RecordingComm (below) and TracingComm (dtc/trace.h).
class ForwardingComm : public Comm {
 public:
  explicit ForwardingComm(c10::intrusive_ptr<Comm> inner);

  /// The wrapped communicator.
  const c10::intrusive_ptr<Comm>& inner() const { return inner_; }

  const std::string getBackendName() const override;
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
      std::vector<int64_t>& input_splits,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  // Groups (start/endCoalescing) are passed on as they are.
#if TORCH_VERSION_MAJOR >= 2
  bool supportsCoalescing() const override { return inner_->supportsCoalescing(); }
  void startCoalescing() override { inner_->startCoalescing(); }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override { return inner_->endCoalescing(); }
#else
  void startCoalescing() override { inner_->startCoalescing(); }
  void endCoalescing(std::vector<c10::intrusive_ptr<c10d::Work>>& reqs) override {
    inner_->endCoalescing(reqs);
  }
#endif

 protected:
  /// One operation: its name ("allreduce", "send", ...), this rank's bytes (recv: the bytes
  /// received; allgather: sent), the peer of a send or receive or the root of a broadcast or
  /// reduce (-1: none), the tag of a send or receive (-1), and @p issue, which makes the call on
  /// inner(). Returns the Work to hand out; the default just issues it.
  virtual c10::intrusive_ptr<c10d::Work> call(
      const char* op, int64_t bytes, int peer, int tag,
      const std::function<c10::intrusive_ptr<c10d::Work>()>& issue);

  c10::intrusive_ptr<Comm> inner_;
};

/// A Work that forwards everything to @p inner; a subclass sees each wait() through
/// before_wait() and after_wait().
class ForwardingWork : public c10d::Work {
 public:
  explicit ForwardingWork(c10::intrusive_ptr<c10d::Work> inner) : inner_(std::move(inner)) {}
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  bool wait(std::chrono::milliseconds timeout) override {
    before_wait();
    const bool ok = inner_->wait(timeout);
    after_wait();
    return ok;
  }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }

 protected:
  virtual void before_wait() {}
  virtual void after_wait() {}
  c10::intrusive_ptr<c10d::Work> inner_;
};

/// A Comm that forwards every call to @p inner and records it (thread-safe). Use it where the
/// learner's code takes a Comm; read events() after.
class RecordingComm : public ForwardingComm {
 public:
  explicit RecordingComm(c10::intrusive_ptr<Comm> inner);

  /// Records a mark of the test's own in the same order as the calls.
  void mark(const std::string& label);
  /// Every event so far, in order.
  std::vector<CommEvent> events() const;
  /// The events of one operation, in order.
  std::vector<CommEvent> events(const std::string& op) const;
  /// The total bytes of one operation's calls.
  int64_t bytes(const std::string& op) const;
  /// What this rank put on the wire over all its calls: dtc::wire_bytes() of each, in this
  /// communicator's size.
  double wire_bytes() const;
  /// Forgets every event.
  void clear();
  /// The bytes this rank's all-to-alls sent to the other ranks of the group (CommEvent::sent_to
  /// without its own entry), over every call so far.
  int64_t alltoall_bytes_to_others() const;

  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
      std::vector<int64_t>& input_splits,
      const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;

  // Groups are recorded on every backend, and passed on where the wrapped one has them.
#if TORCH_VERSION_MAJOR >= 2
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
#else
  void startCoalescing() override;
  void endCoalescing(std::vector<c10::intrusive_ptr<c10d::Work>>& reqs) override;
#endif

 protected:
  c10::intrusive_ptr<c10d::Work> call(
      const char* op, int64_t bytes, int peer, int tag,
      const std::function<c10::intrusive_ptr<c10d::Work>()>& issue) override;

 private:
  int64_t record(const char* op, int64_t bytes, int peer, const std::string& label = "",
                 int64_t id = -1, int tag = -1);
  c10::intrusive_ptr<c10d::Work> wrap(c10::intrusive_ptr<c10d::Work> work, int64_t call,
                                      const char* op);
  class RecordedWork;

  mutable std::mutex mu_;
  std::vector<CommEvent> events_;
};

/// The bytes this rank puts on the wire for one call of @p op over @p n ranks, from its
/// CommEvent::bytes, in NCCL's ring algorithms (nccl-tests' bus factors against the whole
/// array): an allreduce 2(n-1)/n of it, a reduce-scatter and an all-to-all (n-1)/n of the
/// input, an all-gather n - 1 inputs, a broadcast, a reduce and a send the bytes, a receive
/// nothing. A group of one sends nothing (a send still sends).
double wire_bytes(const std::string& op, int64_t bytes, int64_t n);

/// The bytes of @p tensors (numel x element size, summed).
int64_t tensor_bytes(const std::vector<at::Tensor>& tensors);

}  // namespace dtc
