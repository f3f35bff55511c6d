#include "dtc/observe.h"

#include "dtc/memory.h"

namespace dtc {

int64_t tensor_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}

ForwardingComm::ForwardingComm(c10::intrusive_ptr<Comm> inner)
    : Comm(inner->getRank(), inner->getSize()), inner_(std::move(inner)) {}

c10::intrusive_ptr<c10d::Work> ForwardingComm::call(
    const char* /*op*/, int64_t /*bytes*/, int /*peer*/, int /*tag*/,
    const std::function<c10::intrusive_ptr<c10d::Work>()>& issue) {
  return issue();
}

const std::string ForwardingComm::getBackendName() const { return inner_->getBackendName(); }

c10::intrusive_ptr<c10d::Work> ForwardingComm::broadcast(std::vector<at::Tensor>& tensors,
                                                         const c10d::BroadcastOptions& opts) {
  return call("broadcast", tensor_bytes(tensors), static_cast<int>(opts.rootRank), -1,
              [&] { return inner_->broadcast(tensors, opts); });
}

c10::intrusive_ptr<c10d::Work> ForwardingComm::allreduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  return call("allreduce", tensor_bytes(tensors), -1, -1,
              [&] { return inner_->allreduce(tensors, opts); });
}

c10::intrusive_ptr<c10d::Work> ForwardingComm::reduce(std::vector<at::Tensor>& tensors,
                                                      const c10d::ReduceOptions& opts) {
  return call("reduce", tensor_bytes(tensors), static_cast<int>(opts.rootRank), -1,
              [&] { return inner_->reduce(tensors, opts); });
}

c10::intrusive_ptr<c10d::Work> ForwardingComm::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return call("allgather", tensor_bytes(inputs), -1, -1,
              [&] { return inner_->allgather(outputs, inputs, opts); });
}

c10::intrusive_ptr<c10d::Work> ForwardingComm::_allgather_base(at::Tensor& output,
                                                               at::Tensor& input,
                                                               const c10d::AllgatherOptions& opts) {
  return call("allgather", tensor_bytes({input}), -1, -1,
              [&] { return inner_->_allgather_base(output, input, opts); });
}

c10::intrusive_ptr<c10d::Work> ForwardingComm::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  int64_t n = 0;
  for (const auto& list : inputs) n += tensor_bytes(list);
  return call("reduce_scatter", n, -1, -1,
              [&] { return inner_->reduce_scatter(outputs, inputs, opts); });
}

c10::intrusive_ptr<c10d::Work> ForwardingComm::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  return call("reduce_scatter", tensor_bytes({input}), -1, -1,
              [&] { return inner_->_reduce_scatter_base(output, input, opts); });
}

c10::intrusive_ptr<c10d::Work> ForwardingComm::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                             std::vector<int64_t>& output_splits,
                                                             std::vector<int64_t>& input_splits,
                                                             const c10d::AllToAllOptions& opts) {
  return call("alltoall", tensor_bytes({input}), -1, -1, [&] {
    return inner_->alltoall_base(output, input, output_splits, input_splits, opts);
  });
}

c10::intrusive_ptr<c10d::Work> ForwardingComm::send(std::vector<at::Tensor>& tensors, int dst,
                                                    int tag) {
  return call("send", tensor_bytes(tensors), dst, tag,
              [&] { return inner_->send(tensors, dst, tag); });
}

c10::intrusive_ptr<c10d::Work> ForwardingComm::recv(std::vector<at::Tensor>& tensors, int src,
                                                    int tag) {
  return call("recv", tensor_bytes(tensors), src, tag,
              [&] { return inner_->recv(tensors, src, tag); });
}

c10::intrusive_ptr<c10d::Work> ForwardingComm::barrier(const c10d::BarrierOptions& opts) {
  return call("barrier", 0, -1, -1, [&] { return inner_->barrier(opts); });
}

RecordingComm::RecordingComm(c10::intrusive_ptr<Comm> inner) : ForwardingComm(std::move(inner)) {}

int64_t RecordingComm::record(const char* op, int64_t bytes, int peer, const std::string& label,
                              int64_t id, int tag) {
  std::lock_guard<std::mutex> lock(mu_);
  CommEvent e;
  e.op = op;
  e.label = label;
  e.bytes = bytes;
  e.peer = peer;
  e.seq = static_cast<int64_t>(events_.size());
  e.id = id;
  e.tag = tag;
  e.thread = std::this_thread::get_id();
  e.t = std::chrono::steady_clock::now();
  if (counting_allocator_installed()) e.thread_bytes = thread_cpu_memory().current;
  events_.push_back(std::move(e));
  return events_.back().seq;
}

// A Work that records its wait() in the RecordingComm that made it, and forwards everything.
class RecordingComm::RecordedWork : public ForwardingWork {
 public:
  RecordedWork(c10::intrusive_ptr<c10d::Work> inner, RecordingComm* comm, int64_t call,
               const char* op)
      : ForwardingWork(std::move(inner)), comm_(comm), call_(call), op_(op) {}

 protected:
  void before_wait() override { comm_->record("wait", 0, -1, op_, call_); }

 private:
  RecordingComm* comm_;  // outlives its Works in a test (the test owns both)
  int64_t call_;
  const char* op_;
};

c10::intrusive_ptr<c10d::Work> RecordingComm::wrap(c10::intrusive_ptr<c10d::Work> work,
                                                   int64_t call, const char* op) {
  // No Work (an NCCL operation inside a group has none of its own): nothing to wrap.
  if (!work) return work;
  return c10::make_intrusive<RecordedWork>(std::move(work), this, call, op);
}

void RecordingComm::mark(const std::string& label) { record("mark", 0, -1, label); }

std::vector<CommEvent> RecordingComm::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

std::vector<CommEvent> RecordingComm::events(const std::string& op) const {
  std::vector<CommEvent> out;
  for (auto& e : events()) {
    if (e.op == op) out.push_back(e);
  }
  return out;
}

int64_t RecordingComm::bytes(const std::string& op) const {
  int64_t n = 0;
  for (const auto& e : events(op)) n += e.bytes;
  return n;
}

double RecordingComm::wire_bytes() const {
  double n = 0;
  for (const auto& e : events()) n += dtc::wire_bytes(e.op, e.bytes, getSize());
  return n;
}

double wire_bytes(const std::string& op, int64_t bytes, int64_t n) {
  const double b = static_cast<double>(bytes);
  const double k = static_cast<double>(n);
  if (n <= 1 && op != "send") return 0;
  if (op == "allreduce") return 2 * (k - 1) / k * b;
  if (op == "reduce_scatter" || op == "alltoall") return (k - 1) / k * b;
  if (op == "allgather") return (k - 1) * b;
  if (op == "broadcast" || op == "reduce" || op == "send") return b;
  return 0;  // recv, barrier, the marks of a group
}

c10::intrusive_ptr<c10d::Work> RecordingComm::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                            std::vector<int64_t>& output_splits,
                                                            std::vector<int64_t>& input_splits,
                                                            const c10d::AllToAllOptions& opts) {
  const int64_t n = getSize();
  const int64_t rows = input.dim() == 0 ? 0 : input.size(0);
  const int64_t row_bytes = rows == 0 ? 0 : tensor_bytes({input}) / rows;
  std::vector<int64_t> sent(static_cast<size_t>(n), n == 0 ? 0 : rows / n * row_bytes);
  if (!input_splits.empty()) {
    for (size_t q = 0; q < sent.size() && q < input_splits.size(); ++q) {
      sent[q] = input_splits[q] * row_bytes;
    }
  }
  const int64_t id = record("alltoall", tensor_bytes({input}), -1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_[static_cast<size_t>(id)].sent_to = std::move(sent);
  }
  return wrap(inner_->alltoall_base(output, input, output_splits, input_splits, opts), id,
              "alltoall");
}

int64_t RecordingComm::alltoall_bytes_to_others() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  const auto self = static_cast<size_t>(getRank());
  for (const CommEvent& e : events_) {
    for (size_t q = 0; q < e.sent_to.size(); ++q) {
      if (q != self) total += e.sent_to[q];
    }
  }
  return total;
}

void RecordingComm::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  events_.clear();
}

c10::intrusive_ptr<c10d::Work> RecordingComm::call(
    const char* op, int64_t bytes, int peer, int tag,
    const std::function<c10::intrusive_ptr<c10d::Work>()>& issue) {
  const int64_t id = record(op, bytes, peer, "", -1, tag);
  return wrap(issue(), id, op);
}

#if TORCH_VERSION_MAJOR >= 2
void RecordingComm::startCoalescing() {
  record("group_start", 0, -1);
  if (inner_->supportsCoalescing()) inner_->startCoalescing();
}

c10::intrusive_ptr<c10d::Work> RecordingComm::endCoalescing() {
  const int64_t call = record("group_end", 0, -1);
  if (!inner_->supportsCoalescing()) return nullptr;  // gloo: the ops' own Works
  return wrap(inner_->endCoalescing(), call, "group_end");
}
#else
void RecordingComm::startCoalescing() {
  record("group_start", 0, -1);
  inner_->startCoalescing();
}

void RecordingComm::endCoalescing(std::vector<c10::intrusive_ptr<c10d::Work>>& reqs) {
  record("group_end", 0, -1);
  inner_->endCoalescing(reqs);
}
#endif

}  // namespace dtc
