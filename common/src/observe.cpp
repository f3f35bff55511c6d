#include "dtc/observe.h"

#include "dtc/memory.h"

namespace dtc {

int64_t tensor_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}

RecordingComm::RecordingComm(c10::intrusive_ptr<Comm> inner)
    : Comm(inner->getRank(), inner->getSize()), inner_(std::move(inner)) {}

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
class RecordingComm::RecordedWork : public c10d::Work {
 public:
  RecordedWork(c10::intrusive_ptr<c10d::Work> inner, RecordingComm* comm, int64_t call,
               const char* op)
      : inner_(std::move(inner)), comm_(comm), call_(call), op_(op) {}
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  bool wait(std::chrono::milliseconds timeout) override {
    comm_->record("wait", 0, -1, op_, call_);
    return inner_->wait(timeout);
  }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
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

void RecordingComm::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  events_.clear();
}

const std::string RecordingComm::getBackendName() const { return inner_->getBackendName(); }

c10::intrusive_ptr<c10d::Work> RecordingComm::broadcast(std::vector<at::Tensor>& tensors,
                                                        const c10d::BroadcastOptions& opts) {
  const int64_t call = record("broadcast", tensor_bytes(tensors), static_cast<int>(opts.rootRank));
  return wrap(inner_->broadcast(tensors, opts), call, "broadcast");
}

c10::intrusive_ptr<c10d::Work> RecordingComm::allreduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::AllreduceOptions& opts) {
  const int64_t call = record("allreduce", tensor_bytes(tensors), -1);
  return wrap(inner_->allreduce(tensors, opts), call, "allreduce");
}

c10::intrusive_ptr<c10d::Work> RecordingComm::reduce(std::vector<at::Tensor>& tensors,
                                                     const c10d::ReduceOptions& opts) {
  const int64_t call = record("reduce", tensor_bytes(tensors), static_cast<int>(opts.rootRank));
  return wrap(inner_->reduce(tensors, opts), call, "reduce");
}

c10::intrusive_ptr<c10d::Work> RecordingComm::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const int64_t call = record("allgather", tensor_bytes(inputs), -1);
  return wrap(inner_->allgather(outputs, inputs, opts), call, "allgather");
}

c10::intrusive_ptr<c10d::Work> RecordingComm::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                              const c10d::AllgatherOptions& opts) {
  const int64_t call = record("allgather", tensor_bytes({input}), -1);
  return wrap(inner_->_allgather_base(output, input, opts), call, "allgather");
}

c10::intrusive_ptr<c10d::Work> RecordingComm::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  int64_t n = 0;
  for (const auto& list : inputs) n += tensor_bytes(list);
  const int64_t call = record("reduce_scatter", n, -1);
  return wrap(inner_->reduce_scatter(outputs, inputs, opts), call, "reduce_scatter");
}

c10::intrusive_ptr<c10d::Work> RecordingComm::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const int64_t call = record("reduce_scatter", tensor_bytes({input}), -1);
  return wrap(inner_->_reduce_scatter_base(output, input, opts), call, "reduce_scatter");
}

c10::intrusive_ptr<c10d::Work> RecordingComm::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                            std::vector<int64_t>& output_splits,
                                                            std::vector<int64_t>& input_splits,
                                                            const c10d::AllToAllOptions& opts) {
  const int64_t call = record("alltoall", tensor_bytes({input}), -1);
  return wrap(inner_->alltoall_base(output, input, output_splits, input_splits, opts), call,
              "alltoall");
}

c10::intrusive_ptr<c10d::Work> RecordingComm::send(std::vector<at::Tensor>& tensors, int dst,
                                                   int tag) {
  const int64_t call = record("send", tensor_bytes(tensors), dst, "", -1, tag);
  return wrap(inner_->send(tensors, dst, tag), call, "send");
}

c10::intrusive_ptr<c10d::Work> RecordingComm::recv(std::vector<at::Tensor>& tensors, int src,
                                                   int tag) {
  const int64_t call = record("recv", tensor_bytes(tensors), src, "", -1, tag);
  return wrap(inner_->recv(tensors, src, tag), call, "recv");
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

c10::intrusive_ptr<c10d::Work> RecordingComm::barrier(const c10d::BarrierOptions& opts) {
  const int64_t call = record("barrier", 0, -1);
  return wrap(inner_->barrier(opts), call, "barrier");
}

}  // namespace dtc
