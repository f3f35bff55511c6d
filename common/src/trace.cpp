#include "dtc/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>

#include "dtc/memory.h"
#include "dtc/observe.h"

#if defined(DTC_HAVE_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace dtc {

namespace {

thread_local Tracer* g_active = nullptr;

// "<name> <index>", or "<name><index>" for a one-letter name (F3, B3: the papers' labels).
std::string span_name(const char* name, int64_t index) {
  if (index < 0) return name;
  const bool letter = name[0] != '\0' && name[1] == '\0';
  return letter ? fmt::format("{}{}", name, index) : fmt::format("{} {}", name, index);
}

int64_t ns_of(Tracer::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// A CUDA event recorded on the current stream of @p device, or null off CUDA (or when the
// runtime refuses: the span then falls back to the host's time, and the error is cleared so
// that it does not surface in the next unrelated CUDA call).
std::shared_ptr<void> record_event(const torch::Device& device) {
#if defined(DTC_HAVE_CUDA)
  if (device.is_cuda()) {
    // The calling thread's current device may be another (autograd's and c10d's threads, a
    // rank whose device was never made current): events belong to the device they are made on.
    const c10::cuda::CUDAGuard guard(device.index());
    cudaEvent_t event = nullptr;
    if (cudaEventCreate(&event) != cudaSuccess) {
      (void)cudaGetLastError();
      return nullptr;
    }
    if (cudaEventRecord(event, c10::cuda::getCurrentCUDAStream(device.index()).stream()) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      cudaEventDestroy(event);
      return nullptr;
    }
    const int index = device.index();
    return std::shared_ptr<void>(event, [index](void* e) {
      // In destructors: the runtime's own calls, which return errors rather than throw
      // (CUDAGuard throws), the device put back, the error cleared.
      int current = -1;
      const bool switched = cudaGetDevice(&current) == cudaSuccess && current != index &&
                            cudaSetDevice(index) == cudaSuccess;
      cudaEventDestroy(static_cast<cudaEvent_t>(e));
      if (switched) cudaSetDevice(current);
      (void)cudaGetLastError();
    });
  }
#endif
  (void)device;
  return nullptr;
}

// Milliseconds from @p base to @p event, both recorded on the device (waits for @p event);
// NaN when the runtime cannot tell.
double event_ms(const std::shared_ptr<void>& base, const std::shared_ptr<void>& event) {
#if defined(DTC_HAVE_CUDA)
  float ms = 0;
  if (cudaEventSynchronize(static_cast<cudaEvent_t>(event.get())) == cudaSuccess &&
      cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(base.get()),
                           static_cast<cudaEvent_t>(event.get())) == cudaSuccess) {
    return ms;
  }
  (void)cudaGetLastError();
#endif
  (void)base;
  (void)event;
  return std::numeric_limits<double>::quiet_NaN();
}

#if defined(DTC_HAVE_CUDA)
// An anchor of the device's timer on the host's clock: an event recorded on the idle device
// (the caller holds its guard), at the host time halfway between the call that records it and
// the return of the wait for it (the device stamps it in between); null event on failure.
struct Anchor {
  std::shared_ptr<void> event;
  Tracer::Clock::time_point host;
  double error_us = 0;  // half the round trip
};

Anchor anchor(const torch::Device& device) {
  Anchor a;
  if (cudaDeviceSynchronize() != cudaSuccess) (void)cudaGetLastError();
  const auto before = Tracer::Clock::now();
  a.event = record_event(device);
  if (a.event && cudaEventSynchronize(static_cast<cudaEvent_t>(a.event.get())) != cudaSuccess) {
    (void)cudaGetLastError();
    a.event.reset();
  }
  const auto after = Tracer::Clock::now();
  a.host = before + (after - before) / 2;
  a.error_us = std::chrono::duration<double, std::micro>(after - before).count() / 2;
  return a;
}
#endif

}  // namespace

// ---------------------------------------------------------------------------------------------
// Comm spans: open at issue, closed once by whichever sees the completion first
// ---------------------------------------------------------------------------------------------

namespace {

struct OpenComm {
  std::mutex mu;
  bool done = false;
  // Who records the span. A span that completes on gloo's thread (or is waited for) may
  // outlive its tracer: it holds it weakly and is dropped. A watched one (CUDA) ends on the
  // tracer's own watcher thread, which the tracer joins before it dies: it holds it plainly, so
  // that the watcher never becomes the tracer's last owner (and would join itself).
  std::weak_ptr<Tracer> tracer;
  Tracer* owner = nullptr;  // watched spans
  std::string op;
  nlohmann::json args;
  TraceTime issued;
  bool watched = false;                 // CUDA: only the watcher ends the span
  c10::intrusive_ptr<c10d::Work> work;  // the watched Work, until it has ended
  size_t index = 0;                     // the span's record, once done
  bool waited = false;
  TraceTime wait{};

  // wait() was called on the Work: the first call is recorded (on CUDA, as an event on the
  // current stream, like the compute spans), on the span if it has ended.
  void waiting() {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (waited) return;
    }
    TraceTime t{Tracer::Clock::now(), nullptr};
    auto tr = tracer.lock();
    if (tr) t = tr->now();
    std::lock_guard<std::mutex> lock(mu);
    if (waited) return;
    waited = true;
    wait = t;
    if (done && tr) tr->set_wait(index, t);
  }

  void finish(const char* how) {
    const auto t = Tracer::Clock::now();
    std::lock_guard<std::mutex> lock(mu);
    if (done) return;
    done = true;
    work.reset();
    std::shared_ptr<Tracer> held;
    Tracer* tr = owner;
    if (!tr) {
      held = tracer.lock();
      tr = held.get();
    }
    if (!tr) return;
    args["end"] = how;
    index = tr->span(op, "comm", TraceTrack::kComm, issued, TraceTime{t, nullptr}, std::move(args));
    if (waited) tr->set_wait(index, wait);
  }
};

// A Work that records its first wait(), closes its span when wait() returns (unless a watcher
// ends it: on NCCL wait() does not block the host), and forwards everything.
class TracedWork : public ForwardingWork {
 public:
  TracedWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<OpenComm> open)
      : ForwardingWork(std::move(inner)), open_(std::move(open)) {}

 protected:
  void before_wait() override { open_->waiting(); }
  void after_wait() override {
    if (!open_->watched) open_->finish("wait");
  }

 private:
  std::shared_ptr<OpenComm> open_;
};

}  // namespace

// On CUDA: a thread that polls the open works' isCompleted() (NCCL's end event) every 50 us
// while any is open, and sleeps while none is.
class Tracer::CommWatch {
 public:
  explicit CommWatch(int device) : device_(device), thread_([this] { loop(); }) {}
  ~CommWatch() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  /// Waits until no watched span is open, or @p limit has passed; true when none is.
  bool drain(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mu_);
    return drained_.wait_for(lock, limit, [this] { return open_.empty(); });
  }
  void add(std::shared_ptr<OpenComm> open) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_.push_back(std::move(open));
    }
    cv_.notify_all();
  }

 private:
  void loop() {
#if defined(DTC_HAVE_CUDA)
    // isCompleted queries events of this device
    if (device_ >= 0 && cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
#endif
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (open_.empty()) {
        cv_.wait(lock, [this] { return stop_ || !open_.empty(); });
        continue;
      }
      std::vector<std::shared_ptr<OpenComm>> open = open_;
      lock.unlock();
      std::vector<OpenComm*> finished;
      for (const auto& o : open) {
        c10::intrusive_ptr<c10d::Work> work;
        {
          std::lock_guard<std::mutex> l(o->mu);
          if (!o->done) work = o->work;
        }
        const char* how = "watch";
        bool ended = !work;
        if (work) {
          try {
            ended = work->isCompleted();
          } catch (const std::exception&) {  // a failed or aborted operation: it has ended
            ended = true;
            how = "error";
          }
        }
        if (ended) {
          o->finish(how);
          finished.push_back(o.get());
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      lock.lock();
      open_.erase(std::remove_if(open_.begin(), open_.end(),
                                 [&](const std::shared_ptr<OpenComm>& o) {
                                   return std::find(finished.begin(), finished.end(), o.get()) !=
                                          finished.end();
                                 }),
                  open_.end());
      if (open_.empty()) drained_.notify_all();
    }
  }

  int device_;
  std::mutex mu_;
  std::condition_variable cv_, drained_;
  bool stop_ = false;
  std::vector<std::shared_ptr<OpenComm>> open_;
  std::thread thread_;
};

// ---------------------------------------------------------------------------------------------
// The tracer
// ---------------------------------------------------------------------------------------------

Tracer::Tracer(int rank, torch::Device device) : Tracer(rank, device, device.is_cuda()) {}

Tracer::Tracer(int rank, torch::Device device, bool watch) : rank_(rank), device_(device) {
  base_.host = Clock::now();
#if defined(DTC_HAVE_CUDA)
  if (device_.is_cuda()) {
    // The device clock's origin (no event: host times). The watcher thread starts after, so
    // that it does not delay the anchor.
    const c10::cuda::CUDAGuard guard(device_.index());
    const Anchor origin = anchor(device_);
    base_.event = origin.event;
    base_.host = origin.host;
    if (base_.event) {
      bases_.push_back(base_.event);
      last_base_ = base_.host;
    }
  }
#endif
  if (watch) watch_ = std::make_unique<CommWatch>(device_.is_cuda() ? device_.index() : -1);
  clock_.origin_ns = ns_of(base_.host);
  clock_.local_ns = clock_.origin_ns;
}

Tracer::~Tracer() = default;

void Tracer::set_clock(const ClockSync& clock) {
  clock_ = clock;
  has_end_clock_ = false;
}

void Tracer::set_end_clock(const ClockSync& clock) {
  end_clock_ = clock;
  has_end_clock_ = clock.local_ns > clock_.local_ns;
}

TraceTime Tracer::now() const {
  TraceTime t;
  t.host = Clock::now();
  if (!base_.event) return t;
  {
    // cudaEventElapsedTime answers in float milliseconds: 24 bits, a microsecond's resolution
    // for the first 16 s only. Each second a new base event on the stream: a time is measured
    // from the latest base, and the bases from each other, summed in double.
    std::lock_guard<std::mutex> lock(base_mu_);
    if (t.host - last_base_ > std::chrono::seconds(1)) {
      if (auto base = record_event(device_)) {
        bases_.push_back(std::move(base));
        last_base_ = t.host;
      }
    }
    t.base = static_cast<uint32_t>(bases_.size() - 1);
  }
  t.event = record_event(device_);
  return t;
}

size_t Tracer::span(std::string name, const char* cat, TraceTrack track, const TraceTime& begin,
                    const TraceTime& end, nlohmann::json args) {
  std::lock_guard<std::mutex> lock(mu_);
  records_.push_back({std::move(name), cat, track, begin, end, std::move(args)});
  return records_.size() - 1;
}

void Tracer::set_wait(size_t index, const TraceTime& t) {
  std::lock_guard<std::mutex> lock(mu_);
  if (index >= records_.size() || records_[index].waited) return;
  records_[index].waited = true;
  records_[index].wait = t;
}

void Tracer::memory(const TraceTime& t) {
  int64_t bytes = -1;
  if (device_.is_cuda()) {
    bytes = cuda_memory_stats(device_.index()).allocated;
  } else if (counting_allocator_installed()) {
    bytes = cpu_memory().current;
  }
  if (bytes < 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  records_.push_back({"bytes in use", "memory", TraceTrack::kMemory, t, t, {}, bytes});
}

c10::intrusive_ptr<c10d::Work> Tracer::comm(const std::shared_ptr<Tracer>& tracer,
                                            c10::intrusive_ptr<c10d::Work> work,
                                            nlohmann::json args, const char* op,
                                            const TraceTime& issued) {
  if (!work || !tracer) return work;  // an op inside an NCCL group: the group's span has it
  auto open = std::make_shared<OpenComm>();
  open->tracer = tracer;
  open->op = op;
  open->args = std::move(args);
  open->issued = issued;
  if (tracer->watch_) {
    open->watched = true;
    open->owner = tracer.get();
    open->work = work;
    tracer->watch_->add(open);
  } else {
    // gloo's collectives complete a future on gloo's thread when they are done; its send and
    // receive have none (they end when wait() returns).
    try {
      work->getFuture()->addCallback([open](c10::ivalue::Future&) { open->finish("done"); });
    } catch (const std::exception&) {
    }
  }
  return c10::make_intrusive<TracedWork>(std::move(work), std::move(open));
}

double Tracer::host_micros(int64_t ns) const {
  // The offset at ns: measured at clock_.local_ns, and at end_clock_.local_ns if measured again,
  // linear in between (and beyond, the nearer one's).
  double offset = static_cast<double>(clock_.offset_ns);
  if (has_end_clock_) {
    const double span = static_cast<double>(end_clock_.local_ns - clock_.local_ns);
    const double f = std::clamp(static_cast<double>(ns - clock_.local_ns) / span, 0.0, 1.0);
    offset += f * static_cast<double>(end_clock_.offset_ns - clock_.offset_ns);
  }
  return (static_cast<double>(ns - clock_.origin_ns) + offset) / 1e3;
}

double Tracer::micros(const TraceTime& t, const DeviceClock& device) const {
  int64_t ns = ns_of(t.host);
  if (t.event && t.base < device.base_ms.size() &&
      device.base_ms[t.base] == device.base_ms[t.base]) {
    const double ms = event_ms(device.bases[t.base], t.event);
    if (ms == ms) {
      ns = ns_of(base_.host) +
           static_cast<int64_t>((device.base_ms[t.base] + ms) * device.scale * 1e6);
    }
  }
  return host_micros(ns);
}

size_t Tracer::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return records_.size();
}

nlohmann::json Tracer::to_json() const {
  // Spans the watcher has yet to close (their operations are complete or about to be): a
  // bounded wait, so that a Work that never completes (a receive nobody sends to) leaves its
  // span out rather than hanging the trace.
  if (watch_) watch_->drain(std::chrono::seconds(2));
  // The device times of the base events, from the first (double; NaN where unknown).
  DeviceClock device_clock;
#if defined(DTC_HAVE_CUDA)
  std::unique_ptr<c10::cuda::CUDAGuard> guard;  // events are read on their device
  if (base_.event) guard = std::make_unique<c10::cuda::CUDAGuard>(device_.index());
#endif
  {
    std::lock_guard<std::mutex> lock(base_mu_);
    device_clock.bases = bases_;
  }
  for (size_t k = 0; k < device_clock.bases.size(); ++k) {
    device_clock.base_ms.push_back(
        k == 0 ? 0.0
               : device_clock.base_ms[k - 1] +
                     event_ms(device_clock.bases[k - 1], device_clock.bases[k]));
  }
#if defined(DTC_HAVE_CUDA)
  // The device's timer and the host's clock drift apart (parts per million): a second anchor,
  // now, as at the start (an idle device, the host time halfway around the event), and device
  // times scaled so that both anchors fall on their host times.
  if (base_.event && !device_clock.bases.empty()) {
    const Anchor last = anchor(device_);
    if (last.event) {
      const double device_ms =
          device_clock.base_ms.back() + event_ms(device_clock.bases.back(), last.event);
      const double host_ms =
          std::chrono::duration<double, std::milli>(last.host - base_.host).count();
      if (device_ms == device_ms && device_ms > 1000.0) device_clock.scale = host_ms / device_ms;
      device_clock.anchor_error_us = last.error_us;
    }
  }
  (void)cudaGetLastError();
#endif
  std::vector<Record> records;
  {
    std::lock_guard<std::mutex> lock(mu_);
    records = records_;
  }
  auto events = nlohmann::json::array();
  auto meta = [&](const char* what, int tid, nlohmann::json args) {
    nlohmann::json e = {{"name", what}, {"ph", "M"}, {"pid", rank_}, {"args", std::move(args)}};
    if (tid >= 0) e["tid"] = tid;
    events.push_back(std::move(e));
  };
  meta("process_name", -1, {{"name", fmt::format("rank {}", rank_)}});
  meta("process_sort_index", -1, {{"sort_index", rank_}});
  meta("thread_name", 0, {{"name", "compute"}});
  meta("thread_sort_index", 0, {{"sort_index", 0}});
  // Comm spans that overlap go to separate lanes (tids 1, 3, 4, ...), so that each lane nests.
  std::vector<std::pair<double, size_t>> comm;  // (begin, index)
  std::vector<double> begin(records.size()), end(records.size());
  double clamped_us = 0;  // the most a comm span's device start fell after its host end
  for (size_t i = 0; i < records.size(); ++i) {
    begin[i] = micros(records[i].begin, device_clock);
    end[i] = records[i].counter >= 0 ? begin[i] : micros(records[i].end, device_clock);
    if (records[i].track == TraceTrack::kComm) {
      // On CUDA a comm span starts at a device event and ends on the host: a start after the
      // host saw the end is the two clocks' alignment error (microseconds), not a negative span.
      if (records[i].begin.event && begin[i] > end[i]) {
        clamped_us = std::max(clamped_us, begin[i] - end[i]);  // in otherData, for the checks
        begin[i] = end[i];
      }
      comm.emplace_back(begin[i], i);
    }
  }
  // Compute spans nest. Backward hooks on one tensor fire in the order they were registered,
  // microseconds apart, so a span can start inside another and end after it: where it started
  // near the other's end (block i+1's backward ends, block i's starts), it starts where that one
  // ends; where it started near the other's start (a micro-batch's backward around its blocks',
  // whose hooks came first), it starts there too, and holds the other. Only by up to
  // kNestSlackUs: two hooks run about 1 us apart (measured: at most 14 us over lessons 06-10 on
  // two oversubscribed cores), more when the thread is descheduled between them (a time
  // slice, milliseconds). The shift is in the span's args ("nest_shift_us"), for the checks to
  // count; a span further off is in the wrong place, and is left crossing, for them to see.
  constexpr double kNestSlackUs = 5000;
  std::vector<size_t> compute;
  std::vector<double> shift(records.size(), 0.0);
  for (size_t i = 0; i < records.size(); ++i) {
    if (records[i].track == TraceTrack::kCompute && records[i].counter < 0) compute.push_back(i);
  }
  // A moved start can change the order the pass saw: repeat it, sorted again, until nothing
  // moves (one or two passes in practice; bounded, in case two spans keep trading places).
  for (int pass = 0; pass < 8; ++pass) {
    std::sort(compute.begin(), compute.end(), [&](size_t a, size_t b) {
      return begin[a] != begin[b] ? begin[a] < begin[b] : end[a] > end[b];
    });
    bool moved = false;
    std::vector<size_t> open;
    for (size_t i : compute) {
      while (!open.empty() && end[open.back()] <= begin[i]) open.pop_back();
      while (!open.empty() && end[i] > end[open.back()]) {
        const size_t top = open.back();
        const bool holds = begin[i] - begin[top] < end[top] - begin[i];
        const double to = holds ? begin[top] : std::max(begin[i], end[top]);
        if (std::abs(shift[i] + to - begin[i]) > kNestSlackUs) break;  // left crossing
        shift[i] += to - begin[i];
        moved = moved || to != begin[i];
        begin[i] = to;
        open.pop_back();
      }
      open.push_back(i);
    }
    if (!moved) break;
  }
  std::sort(comm.begin(), comm.end());
  std::vector<double> lane_free;  // when each lane's last span ended
  std::vector<int> lane_of(records.size(), 1);
  for (const auto& [b, i] : comm) {
    size_t lane = 0;
    while (lane < lane_free.size() && lane_free[lane] > b) ++lane;
    if (lane == lane_free.size()) lane_free.push_back(0);
    lane_free[lane] = end[i];
    lane_of[i] = lane == 0 ? 1 : static_cast<int>(lane) + 2;
  }
  for (size_t lane = 0; lane < std::max<size_t>(1, lane_free.size()); ++lane) {
    const int tid = lane == 0 ? 1 : static_cast<int>(lane) + 2;
    meta("thread_name", tid,
         {{"name", lane == 0 ? std::string("comm") : fmt::format("comm {}", lane + 1)}});
    meta("thread_sort_index", tid, {{"sort_index", tid == 1 ? 1 : tid}});
  }
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    if (r.counter >= 0) {
      events.push_back({{"name", r.name},
                        {"ph", "C"},
                        {"ts", begin[i]},
                        {"pid", rank_},
                        {"args", {{"bytes", r.counter}}}});
      continue;
    }
    nlohmann::json e = {{"name", r.name},
                        {"cat", r.cat},
                        {"ph", "X"},
                        {"ts", begin[i]},
                        {"dur", end[i] - begin[i]},
                        {"pid", rank_},
                        {"tid", r.track == TraceTrack::kComm ? lane_of[i] : 0}};
    if (!r.args.empty()) e["args"] = r.args;
    if (shift[i] != 0) e["args"]["nest_shift_us"] = shift[i];
    if (r.waited) e["args"]["wait_us"] = micros(r.wait, device_clock);
    events.push_back(std::move(e));
  }
  nlohmann::json other = {
      {"rank", rank_},
      {"device", device_.str()},
      {"libtorch", torch_version()},
      {"clock",
       {{"method",
         "steady clock; offset from rank 0's by Cristian's algorithm through the store (the "
         "round with the shortest trip); error <= rtt / 2"},
        {"offset_us", static_cast<double>(clock_.offset_ns) / 1e3},
        {"rtt_us", static_cast<double>(clock_.rtt_ns) / 1e3},
        {"rounds", clock_.rounds},
        {"end_offset_us", has_end_clock_
                              ? nlohmann::json(static_cast<double>(end_clock_.offset_ns) / 1e3)
                              : nlohmann::json()},
        {"end_rtt_us", has_end_clock_ ? nlohmann::json(static_cast<double>(end_clock_.rtt_ns) / 1e3)
                                      : nlohmann::json()}}},
      {"compute_clock", base_.event ? "CUDA events on the current stream" : "host"},
      {"device_clock", base_.event
                           ? nlohmann::json{{"scale", device_clock.scale},
                                            {"anchor_error_us", device_clock.anchor_error_us},
                                            {"bases", device_clock.bases.size()},
                                            {"comm_start_clamped_us", clamped_us}}
                           : nlohmann::json()},
  };
  return {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}, {"otherData", other}};
}

// ---------------------------------------------------------------------------------------------
// Spans from the course's code
// ---------------------------------------------------------------------------------------------

Tracer* active_tracer() { return g_active; }

TraceScope::TraceScope(Tracer* tracer) : previous_(g_active) { g_active = tracer; }
TraceScope::~TraceScope() { g_active = previous_; }

TraceSpan::TraceSpan(const char* name, int64_t index, const char* cat)
    : tracer_(g_active), name_(name), index_(index), cat_(cat) {
  if (tracer_) begin_ = tracer_->now();
}

TraceSpan::~TraceSpan() {
  if (!tracer_) return;
  const TraceTime end = tracer_->now();
  tracer_->span(span_name(name_, index_), cat_, TraceTrack::kCompute, begin_, end);
  tracer_->memory(end);
}

void trace_backward(const torch::Tensor& input, const torch::Tensor& output, const char* name,
                    int64_t index) {
  Tracer* tracer = g_active;
  if (!tracer || !torch::GradMode::is_enabled() || !output.requires_grad() ||
      !input.requires_grad()) {
    return;
  }
  struct State {
    Tracer* tracer;
    std::string name;
    std::mutex mu;
    TraceTime begin;
    bool begun = false;
  };
  auto state = std::make_shared<State>();
  state->tracer = tracer;
  state->name = span_name(name, index);
  // The output's gradient has arrived: the region's backward starts.
  auto out = output;
  out.register_hook([state](const torch::Tensor&) {
    std::lock_guard<std::mutex> lock(state->mu);
    state->begin = state->tracer->now();
    state->begun = true;
  });
  // The input's gradient is complete (every use of it inside the region has run backward).
  auto in = input;
  in.register_hook([state](const torch::Tensor&) {
    std::lock_guard<std::mutex> lock(state->mu);
    if (!state->begun) return;
    const TraceTime end = state->tracer->now();
    state->tracer->span(state->name, "compute", TraceTrack::kCompute, state->begin, end);
    state->tracer->memory(end);
    state->begun = false;
  });
}

void save_tracer(torch::autograd::AutogradContext* ctx) {
  ctx->saved_data["dtc_tracer"] = reinterpret_cast<int64_t>(g_active);
}

Tracer* saved_tracer(torch::autograd::AutogradContext* ctx) {
  const auto it = ctx->saved_data.find("dtc_tracer");
  return it == ctx->saved_data.end() ? nullptr : reinterpret_cast<Tracer*>(it->second.toInt());
}

// ---------------------------------------------------------------------------------------------
// TracingComm
// ---------------------------------------------------------------------------------------------

TracingComm::TracingComm(c10::intrusive_ptr<Comm> inner, std::shared_ptr<Tracer> tracer,
                         std::string group, std::vector<int> ranks)
    : ForwardingComm(std::move(inner)),
      tracer_(std::move(tracer)),
      group_(std::move(group)),
      ranks_(std::move(ranks)) {
  if (!ranks_.empty() && static_cast<int>(ranks_.size()) != inner_->getSize()) {
    throw std::invalid_argument(fmt::format("TracingComm: group {} names {} ranks, its comm has {}",
                                            group_, ranks_.size(), inner_->getSize()));
  }
}

c10::intrusive_ptr<c10d::Work> TracingComm::call(
    const char* op, int64_t bytes, int peer, int tag,
    const std::function<c10::intrusive_ptr<c10d::Work>()>& issue) {
  const TraceTime issued = tracer_->now();
  auto work = issue();
  nlohmann::json args = {{"group", group_},
                         {"bytes", bytes},
                         {"wire_bytes", std::llround(wire_bytes(op, bytes, inner_->getSize()))}};
  if (!ranks_.empty()) args["ranks"] = ranks_;
  if (peer >= 0) {
    args["peer"] = peer;
    args["peer_rank"] = ranks_.empty() ? peer : ranks_.at(static_cast<size_t>(peer));
  }
  if (tag >= 0) args["tag"] = tag;
  if (!work && grouping_) {  // an op inside a group that has no Work of its own: the group's
    args.erase("group");
    args["op"] = op;
    group_wire_bytes_ += args["wire_bytes"].get<int64_t>();
    group_ops_.push_back(std::move(args));
    group_bytes_ += bytes;
    return work;
  }
  return Tracer::comm(tracer_, std::move(work), std::move(args), op, issued);
}

#if TORCH_VERSION_MAJOR >= 2
void TracingComm::startCoalescing() {
  group_issued_ = tracer_->now();
  inner_->startCoalescing();
  grouping_ = true;
  group_ops_ = nlohmann::json::array();
  group_bytes_ = 0;
  group_wire_bytes_ = 0;
}

c10::intrusive_ptr<c10d::Work> TracingComm::endCoalescing() {
  auto work = inner_->endCoalescing();
  grouping_ = false;
  if (group_ops_.empty()) return work;  // every op had a Work of its own, traced as itself
  nlohmann::json args = {{"group", group_},
                         {"bytes", group_bytes_},
                         {"wire_bytes", group_wire_bytes_},
                         {"ops", group_ops_}};
  if (!ranks_.empty()) args["ranks"] = ranks_;
  group_ops_ = nlohmann::json::array();
  return Tracer::comm(tracer_, std::move(work), std::move(args), "group", group_issued_);
}
#endif

// ---------------------------------------------------------------------------------------------
// One clock, and the files
// ---------------------------------------------------------------------------------------------

namespace {

void set_number(c10d::Store& store, const std::string& key, int64_t value) {
  const std::string s = std::to_string(value);
  store.set(key, std::vector<uint8_t>(s.begin(), s.end()));
}

int64_t get_number(c10d::Store& store, const std::string& key) {
  const auto v = store.get(key);
  return std::stoll(std::string(v.begin(), v.end()));
}

}  // namespace

ClockSync sync_clock(c10d::Store& store, int rank, int world, int rounds,
                     const std::function<Tracer::Clock::time_point()>& now,
                     const std::string& round) {
  ClockSync out;
  out.rounds = rounds;
  const bool start = round == "start";
  const std::string key = fmt::format("dtc/trace/clock/{}/", round);
  if (rank == 0) {
    out.local_ns = ns_of(now());
    out.origin_ns = out.local_ns;
    if (start) set_number(store, key + "origin", out.origin_ns);
    for (int r = 1; r < world; ++r) {
      for (int k = 0; k < rounds; ++k) {
        store.get(fmt::format("{}{}/{}/ping", key, r, k));  // blocks until rank r pings
        set_number(store, fmt::format("{}{}/{}/pong", key, r, k), ns_of(now()));
      }
    }
    return out;
  }
  if (start) out.origin_ns = get_number(store, key + "origin");
  out.rtt_ns = std::numeric_limits<int64_t>::max();
  for (int k = 0; k < rounds; ++k) {
    const int64_t t1 = ns_of(now());
    set_number(store, fmt::format("{}{}/{}/ping", key, rank, k), t1);
    const int64_t t0 = get_number(store, fmt::format("{}{}/{}/pong", key, rank, k));
    const int64_t t2 = ns_of(now());
    if (t2 - t1 < out.rtt_ns) {
      out.rtt_ns = t2 - t1;
      out.local_ns = t1 + (t2 - t1) / 2;
      out.offset_ns = t0 - out.local_ns;
    }
  }
  return out;
}

std::string write_trace(Tracer& tracer, c10d::Store* store, int world, const std::string& dir) {
  namespace fs = std::filesystem;
  if (store && world > 1) {
    ClockSync end = sync_clock(*store, tracer.rank(), world,
                               tracer.clock().rounds > 0 ? tracer.clock().rounds : 8,
                               Tracer::Clock::now, "end");
    tracer.set_end_clock(end);
  }
  fs::create_directories(dir);
  const nlohmann::json mine = tracer.to_json();
  const int rank = tracer.rank();
  {
    std::ofstream f(fs::path(dir) / fmt::format("rank{}.json", rank));
    f << mine.dump();
    if (!f)
      throw std::runtime_error(fmt::format("--trace: cannot write {}/rank{}.json", dir, rank));
  }
  if (store && world > 1 && rank != 0) {
    const std::string s = mine.dump();
    store->set(fmt::format("dtc/trace/rank/{}", rank), std::vector<uint8_t>(s.begin(), s.end()));
    return "";
  }
  if (rank != 0) return "";
  nlohmann::json merged = {{"traceEvents", mine["traceEvents"]},
                           {"displayTimeUnit", "ms"},
                           {"otherData", {{"ranks", nlohmann::json::array({mine["otherData"]})}}}};
  for (int r = 1; store && r < world; ++r) {
    const auto v = store->get(fmt::format("dtc/trace/rank/{}", r));
    const auto theirs = nlohmann::json::parse(std::string(v.begin(), v.end()));
    for (const auto& e : theirs["traceEvents"]) merged["traceEvents"].push_back(e);
    merged["otherData"]["ranks"].push_back(theirs["otherData"]);
  }
  const fs::path path = fs::path(dir) / "trace.json";
  std::ofstream f(path);
  f << merged.dump();
  if (!f) throw std::runtime_error(fmt::format("--trace: cannot write {}", path.string()));
  return path.string();
}

// ---------------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------------

std::vector<TracedSpan> traced_spans(const nlohmann::json& trace) {
  std::vector<TracedSpan> out;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.value("ph", "") != "X") continue;
    TracedSpan s;
    s.name = e.value("name", "");
    s.cat = e.value("cat", "");
    s.rank = e.value("pid", 0);
    s.track = s.cat == "comm" ? TraceTrack::kComm : TraceTrack::kCompute;
    s.begin_us = e.value("ts", 0.0);
    s.end_us = s.begin_us + e.value("dur", 0.0);
    if (e.contains("args")) s.args = e["args"];
    out.push_back(std::move(s));
  }
  std::stable_sort(out.begin(), out.end(), [](const TracedSpan& a, const TracedSpan& b) {
    return a.begin_us < b.begin_us;
  });
  return out;
}

std::vector<TracedSpan> select_spans(const std::vector<TracedSpan>& spans, int rank,
                                     TraceTrack track, const std::string& prefix) {
  std::vector<TracedSpan> out;
  for (const auto& s : spans) {
    if ((rank < 0 || s.rank == rank) && s.track == track && s.name.rfind(prefix, 0) == 0) {
      out.push_back(s);
    }
  }
  return out;
}

}  // namespace dtc
