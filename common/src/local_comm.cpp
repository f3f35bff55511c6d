#include "dtc/local_comm.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace dtc {

bool& local_transport_on_this_thread() {
  thread_local bool on = false;
  return on;
}

namespace {

using Clock = std::chrono::steady_clock;
/// Work::wait()'s "no timeout of its own" (c10d's kNoTimeout, in another namespace per version).
constexpr std::chrono::milliseconds kNoWaitTimeout{0};
struct Group;
class LocalWork;
/// Calls to complete, and how: held weakly (see LocalWork::complete).
using Done = std::vector<std::pair<c10::weak_intrusive_ptr<LocalWork>, std::exception_ptr>>;

std::string shape_of(const at::Tensor& t) {
  return fmt::format("{}[{}]", c10::toString(t.scalar_type()), fmt::join(t.sizes(), ", "));
}

/// The Work of one call: completed by whichever rank's call completes the operation.
class LocalWork : public c10d::Work {
 public:
  LocalWork(std::shared_ptr<Group> group, int rank, std::string what,
            std::chrono::milliseconds timeout, std::vector<at::Tensor> outputs, int source = -1)
      : group_(std::move(group)),
        rank_(rank),
        what_(std::move(what)),
        timeout_(timeout),
        deadline_(Clock::now() + timeout),
        outputs_(std::move(outputs)),
        source_(source),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  bool wait(std::chrono::milliseconds timeout) override;
  int sourceRank() const override { return source_; }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  void synchronize() override {}
  void abort() override {}
  /// The last strong reference is gone: the tensors go now, not when the weak ones (a
  /// communicator's list of calls for its barrier) are gone too.
  void release_resources() override {
    outputs_.clear();
    future_.reset();
    before.clear();
  }

  /// Marks the calls of @p done complete (or failed). Called without the group's lock, as the
  /// futures' callbacks run here, and holding only weak references when each call's waiter
  /// wakes: a received buffer or a sent tensor is then its rank's alone, freed when that rank
  /// lets go of it, as with gloo (whose threads hold no reference to a call's tensors).
  static void complete(Done& done) {
    for (auto& [weak, error] : done) {
      LocalWork* work = nullptr;
      {
        auto strong = weak.lock();
        if (!strong) continue;  // nobody holds the call any more
        if (error) {
          strong->future_->setError(error);
        } else {
          strong->future_->markCompleted(c10::IValue(strong->outputs_));
        }
        work = strong.get();
      }
      work->finish(error);  // alive: `weak` keeps the object (not its tensors) until here
    }
    done.clear();
  }

  std::vector<c10::intrusive_ptr<LocalWork>> before;  ///< barrier: this rank's earlier calls

 private:
  std::shared_ptr<Group> group_;
  int rank_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  Clock::time_point deadline_;
  std::vector<at::Tensor> outputs_;
  int source_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

/// One rank's part of a collective.
struct Part {
  std::vector<at::Tensor> a;  ///< broadcast/allreduce/reduce: the tensors; else the inputs
  std::vector<at::Tensor> b;  ///< the outputs (allgather, reduce_scatter, alltoall)
  std::vector<int64_t> in_splits, out_splits;
  c10::intrusive_ptr<LocalWork> work;
};

/// A collective that not every rank has issued yet.
struct Pending {
  std::string op;
  int64_t root = -1;
  c10d::ReduceOp::RedOpType reduce = c10d::ReduceOp::SUM;
  std::vector<Part> parts;  ///< by rank; a rank's work is null until it has issued the call
  int arrived = 0;
};

struct Message {
  at::Tensor tensor;
  c10::intrusive_ptr<LocalWork> work;
};

/// What the ranks of one communicator share.
struct Group {
  explicit Group(int n) : size(n) {}
  const int size;
  std::mutex mu;
  std::map<int64_t, Pending> collectives;                          // by sequence number
  std::map<std::tuple<int, int, int>, std::deque<Message>> sends;  // (src, dst, tag)
  std::map<std::tuple<int, int, int>, std::deque<Message>> recvs;

  /// Why @p work has not completed, for its timeout message (takes the lock).
  std::string missing(const LocalWork* work) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [seq, p] : collectives) {
      for (const Part& part : p.parts) {
        if (part.work.get() != work) continue;
        std::vector<int> absent;
        for (int r = 0; r < size; ++r) {
          if (!p.parts[r].work) absent.push_back(r);
        }
        return fmt::format("rank(s) {} of the group never issued it (collective #{})",
                           fmt::join(absent, ", "), seq);
      }
    }
    for (const auto& [key, queue] : sends) {
      for (const Message& m : queue) {
        if (m.work.get() == work) {
          return fmt::format("rank {} never posted the matching recv (tag {})", std::get<1>(key),
                             std::get<2>(key));
        }
      }
    }
    for (const auto& [key, queue] : recvs) {
      for (const Message& m : queue) {
        if (m.work.get() == work) {
          return fmt::format("rank {} never sent the matching message (tag {})", std::get<0>(key),
                             std::get<2>(key));
        }
      }
    }
    return "its peers never completed it";
  }
};

bool LocalWork::wait(std::chrono::milliseconds timeout) {
  for (auto& w : before) w->wait(timeout);  // a barrier waits for this rank's earlier calls
  bool done = false;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto limit =
        timeout == kNoWaitTimeout ? deadline_ : std::min(deadline_, Clock::now() + timeout);
    done = cv_.wait_until(lock, limit, [&] { return completed_; });
    if (done && exception_) std::rethrow_exception(exception_);
  }
  if (done) return true;
  throw std::runtime_error(fmt::format(
      "Timed out waiting {}ms for {} on rank {} (local communicator of {} thread-ranks): {}",
      timeout == kNoWaitTimeout ? timeout_.count() : std::min(timeout, timeout_).count(), what_,
      rank_, group_->size, group_->missing(this)));
}

void check_same(const Pending& p, const std::vector<at::Tensor>& mine,
                const std::vector<at::Tensor>& first, int rank) {
  if (mine.size() != first.size()) {
    throw std::runtime_error(fmt::format("{}: rank {} passed {} tensors, rank 0 {}", p.op, rank,
                                         mine.size(), first.size()));
  }
  for (size_t i = 0; i < mine.size(); ++i) {
    if (mine[i].scalar_type() != first[i].scalar_type() || mine[i].numel() != first[i].numel()) {
      throw std::runtime_error(fmt::format("{}: rank {} passed {}, rank 0 {}", p.op, rank,
                                           shape_of(mine[i]), shape_of(first[i])));
    }
  }
}

/// @p x in @p like's shape: gloo matches the ranks' tensors by their elements, not their shapes
/// (a view when it can be, as for every contiguous tensor).
at::Tensor shaped(const at::Tensor& x, const at::Tensor& like) {
  return x.sizes() == like.sizes() ? x : x.reshape(like.sizes());
}

void reduce_into(at::Tensor& acc, const at::Tensor& y, c10d::ReduceOp::RedOpType op) {
  const at::Tensor x = shaped(y, acc);
  switch (op) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG: acc.add_(x); break;  // AVG: divided once all are in
    case c10d::ReduceOp::PRODUCT: acc.mul_(x); break;
    case c10d::ReduceOp::MIN: at::minimum_out(acc, acc, x); break;
    case c10d::ReduceOp::MAX: at::maximum_out(acc, acc, x); break;
    case c10d::ReduceOp::BAND: acc.bitwise_and_(x); break;
    case c10d::ReduceOp::BOR: acc.bitwise_or_(x); break;
    case c10d::ReduceOp::BXOR: acc.bitwise_xor_(x); break;
    default: throw std::runtime_error("unsupported ReduceOp");
  }
}

bool aliases_any(const at::Tensor& out, const std::vector<Part>& parts) {
  for (const Part& p : parts) {
    for (const auto& t : p.a) {
      if (t.defined() && out.is_alias_of(t)) return true;
    }
  }
  return false;
}

/// Moves the data of a collective every rank has issued.
void run(Pending& p, int n) {
  auto& parts = p.parts;
  if (p.op == "barrier") return;
  if (p.op == "broadcast" || p.op == "allreduce" || p.op == "reduce") {
    for (int r = 1; r < n; ++r) check_same(p, parts[r].a, parts[0].a, r);
  }
  if (p.op == "broadcast") {
    for (int r = 0; r < n; ++r) {
      if (r == p.root) continue;
      for (size_t i = 0; i < parts[r].a.size(); ++i) {
        parts[r].a[i].copy_(shaped(parts[p.root].a[i], parts[r].a[i]));
      }
    }
  } else if (p.op == "allreduce" || p.op == "reduce") {
    // Rank 0's tensor accumulates, in its dtype, rank by rank; then the others get a copy.
    const int into = p.op == "reduce" ? static_cast<int>(p.root) : 0;
    for (size_t i = 0; i < parts[into].a.size(); ++i) {
      at::Tensor acc = parts[into].a[i];
      for (int r = 0; r < n; ++r) {
        if (r != into) reduce_into(acc, parts[r].a[i], p.reduce);
      }
      if (p.reduce == c10d::ReduceOp::AVG) acc.div_(n);
      if (p.op == "allreduce") {
        for (int r = 0; r < n; ++r) {
          if (r != into) parts[r].a[i].copy_(shaped(acc, parts[r].a[i]));
        }
      }
    }
  } else if (p.op == "allgather") {  // a: {input}, b: the n outputs
    for (int j = 0; j < n; ++j) {
      if (static_cast<int>(parts[j].b.size()) != n) {
        throw std::runtime_error(fmt::format("allgather: rank {} passed {} outputs for {} ranks", j,
                                             parts[j].b.size(), n));
      }
      for (int r = 0; r < n; ++r) {
        if (parts[j].b[r].numel() != parts[r].a[0].numel()) {
          throw std::runtime_error(
              fmt::format("allgather: rank {}'s output {} is {}, rank {} sent {}", j, r,
                          shape_of(parts[j].b[r]), r, shape_of(parts[r].a[0])));
        }
        parts[j].b[r].view_as(parts[r].a[0]).copy_(parts[r].a[0]);
      }
    }
  } else if (p.op == "_allgather_base") {  // a: {input}, b: {output}
    for (int j = 0; j < n; ++j) {
      const at::Tensor flat = parts[j].b[0].view({-1});
      int64_t at = 0;
      for (int r = 0; r < n; ++r) {
        const int64_t k = parts[r].a[0].numel();
        if (at + k > flat.numel()) {
          throw std::runtime_error(
              fmt::format("_allgather_base: rank {}'s output {} is too small for the ranks' inputs",
                          j, shape_of(parts[j].b[0])));
        }
        flat.narrow(0, at, k).copy_(parts[r].a[0].reshape({-1}));
        at += k;
      }
      if (at != flat.numel()) {
        throw std::runtime_error(
            fmt::format("_allgather_base: rank {}'s output {} is not the {} ranks' inputs together",
                        j, shape_of(parts[j].b[0]), n));
      }
    }
  } else if (p.op == "reduce_scatter" || p.op == "_reduce_scatter_base") {
    // The input rank r gives for rank j: its list's j-th tensor, or the j-th chunk of its flat
    // input. Outputs that alias an input are computed aside first.
    auto chunk = [&](int r, int j) -> at::Tensor {
      if (p.op == "reduce_scatter") return parts[r].a[j];
      const at::Tensor flat = parts[r].a[0].view({-1});
      const int64_t k = parts[j].b[0].numel();
      if (flat.numel() != k * n) {
        throw std::runtime_error(
            fmt::format("_reduce_scatter_base: rank {}'s input {} is not {} x rank {}'s output {}",
                        r, shape_of(parts[r].a[0]), n, j, shape_of(parts[j].b[0])));
      }
      return flat.narrow(0, j * k, k);
    };
    for (int r = 0; r < n; ++r) {
      if (p.op == "reduce_scatter" && static_cast<int>(parts[r].a.size()) != n) {
        throw std::runtime_error(fmt::format(
            "reduce_scatter: rank {} passed {} inputs for {} ranks", r, parts[r].a.size(), n));
      }
    }
    bool alias = false;
    for (int j = 0; j < n; ++j) alias = alias || aliases_any(parts[j].b[0], parts);
    std::vector<at::Tensor> results(n);
    for (int j = 0; j < n; ++j) {
      at::Tensor out = parts[j].b[0];
      for (int r = 0; r < n; ++r) {
        if (chunk(r, j).numel() != out.numel() || chunk(r, j).scalar_type() != out.scalar_type()) {
          throw std::runtime_error(fmt::format("{}: rank {}'s output {}, rank {} gives it {}", p.op,
                                               j, shape_of(out), r, shape_of(chunk(r, j))));
        }
      }
      at::Tensor acc = alias ? chunk(0, j).clone() : out;
      if (!alias) acc.view_as(chunk(0, j)).copy_(chunk(0, j));
      at::Tensor acc_view = acc.view_as(chunk(0, j));
      for (int r = 1; r < n; ++r) reduce_into(acc_view, chunk(r, j), p.reduce);
      if (p.reduce == c10d::ReduceOp::AVG) acc_view.div_(n);
      results[j] = acc;
    }
    if (alias) {
      for (int j = 0; j < n; ++j) parts[j].b[0].view_as(results[j]).copy_(results[j]);
    }
  } else if (p.op == "alltoall") {  // a: {input}, b: {output}
    auto offsets = [n](const std::vector<int64_t>& splits, int64_t rows) {
      std::vector<int64_t> sizes = splits;
      if (sizes.empty()) sizes.assign(n, rows / n);
      std::vector<int64_t> starts(n + 1, 0);
      for (int i = 0; i < n; ++i) starts[i + 1] = starts[i] + sizes[i];
      return starts;
    };
    bool alias = false;
    for (int j = 0; j < n; ++j) alias = alias || aliases_any(parts[j].b[0], parts);
    std::vector<at::Tensor> inputs(n);
    for (int r = 0; r < n; ++r) inputs[r] = alias ? parts[r].a[0].clone() : parts[r].a[0];
    for (int j = 0; j < n; ++j) {
      const at::Tensor& out = parts[j].b[0];
      const auto out_at = offsets(parts[j].out_splits, out.size(0));
      for (int r = 0; r < n; ++r) {
        const auto in_at = offsets(parts[r].in_splits, inputs[r].size(0));
        const int64_t rows = in_at[j + 1] - in_at[j];
        if (rows != out_at[r + 1] - out_at[r]) {
          throw std::runtime_error(
              fmt::format("alltoall: rank {} sends {} rows to rank {}, which expects {}", r, rows,
                          j, out_at[r + 1] - out_at[r]));
        }
        out.narrow(0, out_at[r], rows).copy_(inputs[r].narrow(0, in_at[j], rows));
      }
    }
  } else {
    throw std::runtime_error("unknown collective " + p.op);
  }
}

class LocalComm : public Comm {
 public:
  LocalComm(std::shared_ptr<Group> group, int rank, int size, std::chrono::milliseconds timeout)
      : Comm(rank, size), group_(std::move(group)), timeout_(timeout) {}

  const std::string getBackendName() const override { return "local"; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    check_root(opts.rootRank, "broadcast");
    Part part;
    part.a = tensors;
    return collective("broadcast", std::move(part), tensors, opts.rootRank);
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    check_reduce(opts.reduceOp.op_, "allreduce");
    Part part;
    part.a = tensors;
    return collective("allreduce", std::move(part), tensors, -1, opts.reduceOp.op_);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    check_root(opts.rootRank, "reduce");
    check_reduce(opts.reduceOp.op_, "reduce");
    Part part;
    part.a = tensors;
    return collective("reduce", std::move(part), tensors, opts.rootRank, opts.reduceOp.op_);
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& /*opts*/) override {
    if (inputs.size() != 1 || outputs.size() != 1) {
      throw std::invalid_argument("allgather: one input tensor and one list of outputs");
    }
    Part part;
    part.a = inputs;
    part.b = outputs[0];
    return collective("allgather", std::move(part), outputs[0]);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& /*opts*/) override {
    check_contiguous(output, "_allgather_base");
    Part part;
    part.a = {input};
    part.b = {output};
    return collective("_allgather_base", std::move(part), {output});
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    if (inputs.size() != 1 || outputs.size() != 1) {
      throw std::invalid_argument("reduce_scatter: one output tensor and one list of inputs");
    }
    check_reduce(opts.reduceOp.op_, "reduce_scatter");
    Part part;
    part.a = inputs[0];
    part.b = outputs;
    return collective("reduce_scatter", std::move(part), outputs, -1, opts.reduceOp.op_);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    check_contiguous(input, "_reduce_scatter_base");
    check_reduce(opts.reduceOp.op_, "_reduce_scatter_base");
    Part part;
    part.a = {input};
    part.b = {output};
    return collective("_reduce_scatter_base", std::move(part), {output}, -1, opts.reduceOp.op_);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& /*opts*/) override {
    check_splits(output, output_splits, "output");
    check_splits(input, input_splits, "input");
    Part part;
    part.a = {input};
    part.b = {output};
    part.in_splits = input_splits;
    part.out_splits = output_splits;
    return collective("alltoall", std::move(part), {output});
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& /*opts*/) override {
    std::vector<c10::intrusive_ptr<LocalWork>> before;
    {
      std::lock_guard<std::mutex> lock(mine_);
      for (const auto& w : issued_) {
        if (auto alive = w.lock()) before.push_back(alive);
      }
    }
    auto work = collective("barrier", Part{}, {});
    static_cast<LocalWork*>(work.get())->before = std::move(before);
    return work;
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    check_peer(tensors, dst, "send");
    return p2p(tensors[0], getRank(), dst, tag, /*sending=*/true);
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    check_peer(tensors, src, "recv");
    return p2p(tensors[0], src, getRank(), tag, /*sending=*/false);
  }

 private:
  void check_root(int64_t root, const char* op) const {
    if (root < 0 || root >= getSize()) {
      throw std::invalid_argument(
          fmt::format("{}: root {} is not a rank of this group of {}", op, root, getSize()));
    }
  }
  static void check_reduce(c10d::ReduceOp::RedOpType op, const char* name) {
    // gloo's own refusals: PREMUL_SUM (NCCL's), and AVG before LibTorch 2
    if (op == c10d::ReduceOp::PREMUL_SUM || (op == c10d::ReduceOp::AVG && !kAvg)) {
      throw std::invalid_argument(fmt::format("{}: Cannot use ReduceOp.{} with Gloo", name,
                                              op == c10d::ReduceOp::AVG ? "AVG" : "PREMUL_SUM"));
    }
  }
#if TORCH_VERSION_MAJOR >= 2
  static constexpr bool kAvg = true;
#else
  static constexpr bool kAvg = false;
#endif
  /// gloo in LibTorch 1.13 has no bf16 collectives, no _allgather_base and no reduce_scatter:
  /// refused here too, in its words, so that a thread-rank test fails where a real run would.
  static void check_gloo_1_13(const std::string& name, const Part& part) {
#if TORCH_VERSION_MAJOR < 2
    if (name == "_allgather_base") {
      throw std::invalid_argument("no support for _allgather_base in Gloo process group");
    }
    if (name == "reduce_scatter" || name == "_reduce_scatter_base") {
      throw std::invalid_argument("ProcessGroupGloo does not support reduce_scatter");
    }
    for (const auto* list : {&part.a, &part.b}) {
      for (const auto& t : *list) {
        if (t.scalar_type() == at::kBFloat16) throw std::invalid_argument("Invalid scalar type");
      }
    }
#else
    (void)name;
    (void)part;
#endif
  }
  static void check_contiguous(const at::Tensor& t, const char* op) {
    if (!t.is_contiguous()) {
      throw std::invalid_argument(
          fmt::format("{}: the tensor {} must be contiguous", op, shape_of(t)));
    }
  }
  void check_splits(const at::Tensor& t, const std::vector<int64_t>& splits,
                    const char* which) const {
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    if (splits.empty()) {
      if (rows % getSize() != 0) {
        throw std::invalid_argument(
            fmt::format("alltoall_base: the {} has {} rows, not a multiple of the group's {} ranks",
                        which, rows, getSize()));
      }
      return;
    }
    if (static_cast<int>(splits.size()) != getSize() ||
        std::accumulate(splits.begin(), splits.end(), int64_t{0}) != rows) {
      throw std::invalid_argument(
          fmt::format("alltoall_base: the {} splits [{}] do not split its {} rows among {} ranks",
                      which, fmt::join(splits, ", "), rows, getSize()));
    }
  }
  void check_peer(const std::vector<at::Tensor>& tensors, int peer, const char* op) const {
    if (tensors.size() != 1) {
      throw std::invalid_argument(fmt::format("{}: one tensor, not {}", op, tensors.size()));
    }
    if (peer < 0 || peer >= getSize() || peer == getRank()) {
      throw std::invalid_argument(
          fmt::format("{}: rank {} of a group of {} cannot {} rank {}", op, getRank(), getSize(),
                      std::string(op) == "send" ? "send to" : "receive from", peer));
    }
  }

  /// Notes @p work for a later barrier, without keeping it (or its tensors) alive: a Work
  /// the caller dropped is held by its operation until it completes.
  void remember(const c10::intrusive_ptr<LocalWork>& work) {
    std::lock_guard<std::mutex> lock(mine_);
    issued_.erase(std::remove_if(issued_.begin(), issued_.end(),
                                 [](const auto& w) {
                                   auto alive = w.lock();
                                   return !alive || alive->isCompleted();
                                 }),
                  issued_.end());
    issued_.emplace_back(work);
  }

  c10::intrusive_ptr<c10d::Work> collective(
      const std::string& op, Part part, std::vector<at::Tensor> outputs, int64_t root = -1,
      c10d::ReduceOp::RedOpType reduce = c10d::ReduceOp::SUM) {
    check_gloo_1_13(op, part);
    const int n = getSize();
    const int rank = getRank();
    int64_t seq = 0;
    {
      std::lock_guard<std::mutex> lock(mine_);
      seq = seq_++;
    }
    auto work = c10::make_intrusive<LocalWork>(group_, rank, op, timeout_, std::move(outputs));
    part.work = work;
    if (op != "barrier") remember(work);
    Done done;
    {
      std::lock_guard<std::mutex> lock(group_->mu);
      Pending& p = group_->collectives[seq];
      if (p.parts.empty()) {
        p.op = op;
        p.root = root;
        p.reduce = reduce;
        p.parts.resize(n);
      }
      std::exception_ptr error;
      if (p.op != op || p.root != root || p.reduce != reduce) {
        error = std::make_exception_ptr(std::runtime_error(
            fmt::format("collective #{} does not match: rank {} called {}{}, another rank {}{}",
                        seq, rank, op, root >= 0 ? fmt::format(" (root {})", root) : "", p.op,
                        p.root >= 0 ? fmt::format(" (root {})", p.root) : "")));
      }
      p.parts[rank] = std::move(part);
      if (++p.arrived == n) {
        if (!error) {
          try {
            run(p, n);
          } catch (const c10::Error& e) {
            error = std::make_exception_ptr(std::runtime_error(e.what_without_backtrace()));
          } catch (...) {
            error = std::current_exception();
          }
        }
        for (auto& q : p.parts) done.emplace_back(q.work, error);
        group_->collectives.erase(seq);  // the tensors' references go with it
      } else if (error) {
        // Fail the ranks already there too: nobody can complete this collective.
        for (auto& q : p.parts) {
          if (q.work) done.emplace_back(q.work, error);
        }
      }
    }
    LocalWork::complete(done);
    return work;
  }

  c10::intrusive_ptr<c10d::Work> p2p(const at::Tensor& tensor, int src, int dst, int tag,
                                     bool sending) {
    const int peer = sending ? dst : src;
    auto work = c10::make_intrusive<LocalWork>(
        group_, getRank(),
        fmt::format("{} {} rank {} (tag {})", sending ? "send to" : "recv from", shape_of(tensor),
                    peer, tag),
        timeout_, std::vector<at::Tensor>{tensor}, sending ? -1 : src);
    remember(work);
    Done done;
    {
      std::lock_guard<std::mutex> lock(group_->mu);
      const auto key = std::make_tuple(src, dst, tag);
      auto& theirs = sending ? group_->recvs[key] : group_->sends[key];
      if (theirs.empty()) {
        (sending ? group_->sends[key] : group_->recvs[key]).push_back({tensor, work});
      } else {
        std::exception_ptr error;
        c10::intrusive_ptr<LocalWork> other_work;
        {
          Message other = std::move(theirs.front());
          theirs.pop_front();
          const at::Tensor& from = sending ? tensor : other.tensor;
          const at::Tensor& into = sending ? other.tensor : tensor;
          if (from.numel() != into.numel() || from.scalar_type() != into.scalar_type()) {
            error = std::make_exception_ptr(std::runtime_error(
                fmt::format("rank {} sent {} to rank {} (tag {}), which receives into {}", src,
                            shape_of(from), dst, tag, shape_of(into))));
          } else {
            try {
              into.view_as(from).copy_(from);
            } catch (const c10::Error& e) {
              error = std::make_exception_ptr(std::runtime_error(e.what_without_backtrace()));
            }
          }
          other_work = std::move(other.work);
        }  // the peer's tensor: no reference left here
        done.emplace_back(work, error);
        done.emplace_back(other_work, error);
      }
    }
    LocalWork::complete(done);
    return work;
  }

  std::shared_ptr<Group> group_;
  std::chrono::milliseconds timeout_;
  std::mutex mine_;
  int64_t seq_ = 0;
  std::vector<c10::weak_intrusive_ptr<LocalWork>> issued_;
};

std::string to_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

}  // namespace

c10::intrusive_ptr<Comm> new_local_comm(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                        int size, std::chrono::milliseconds timeout) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw std::invalid_argument(
        fmt::format("new_local_comm: rank {} is not in a group of {}", rank, size));
  }
  // The n-th communicator this rank builds over this store meets the n-th of every other
  // member: rank 0 names it, and all find its shared state by that name.
  static std::atomic<int64_t> next_id{0};
  static std::mutex registry_mu;
  static auto* registry = new std::map<std::string, std::weak_ptr<Group>>();
  const int64_t n = store->add(fmt::format("dtc_local/created/{}", rank), 1);
  const std::string key = fmt::format("dtc_local/{}/id", n);
  std::string id;
  if (rank == 0) {
    id = std::to_string(next_id++);
    store->set(key, std::vector<uint8_t>(id.begin(), id.end()));
  } else {
    id = to_string(store->get(key));
  }
  std::shared_ptr<Group> group;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto& slot = (*registry)[id];
    group = slot.lock();
    if (!group) {
      group = std::make_shared<Group>(size);
      slot = group;
    }
  }
  if (group->size != size) {
    throw std::invalid_argument(
        fmt::format("new_local_comm: rank {} builds a group of {}, another member one of {}", rank,
                    size, group->size));
  }
  return c10::make_intrusive<LocalComm>(std::move(group), rank, size, timeout);
}

}  // namespace dtc
