// Timelines: what each rank did and when, as Chrome trace-event JSON (the format Perfetto,
// ui.perfetto.dev, and chrome://tracing open), one file per rank and one merged for the job.
//
//   --trace DIR   (every training program, lesson 02 on) writes DIR/rank<r>.json on each rank
//                 and DIR/trace.json, all ranks on one clock; scripts/trace_svg.py draws it.
//
// Each rank is a process in the trace (pid = rank) with three tracks (tid):
//   0 compute  spans placed by the course's code: each step, forward and backward of each
//              block (or micro-batch: F3, B3), the optimizer step; nested as they ran
//   1 comm     every collective and point-to-point operation, from the call that issued it to
//              its completion: op, group, bytes, peer, tag (TracingComm)
//   2 memory   a counter: bytes of CPU tensor storage in use (the counting allocator), or of
//              the CUDA caching allocator, read at the end of each compute span
// A comm span under a compute span means the operation was posted before the compute began and
// not waited for until after it (on gloo a send or receive ends at wait(); on NCCL a span starts
// where the compute stream reached the call, so it includes queueing behind earlier operations
// on NCCL's stream): the schedule of an overlap, not a measure of the bytes moving meanwhile.
//
// Why hand-placed spans and not LibTorch's profiler: Kineto (ProfilerResult::save, and on CUDA
// the kernels' device times) is in the PyPI 2.x build but not in Debian's 1.13 (built without
// it: torch.autograd.kineto_available() is False there). Both paths have the legacy profiler
// (RecordProfile writes a Chrome trace, and RecordFunction ranges can carry the lesson's
// names), but it records every ATen operator beside them and has no place for a collective's
// group, bytes, peer or completion. The spans here are few, named by the lesson, the same on
// both paths, and cost one thread-local read when tracing is off. (Merging Kineto's CUDA
// activity on the 2.x path is not done.)
//
// One clock: every rank measures the offset of its steady clock from rank 0's through the
// job's store at start-up, by Cristian's algorithm: it writes a ping key, rank 0 answers with
// its clock, and the offset is rank 0's time minus the midpoint of the round trip, from the
// round with the shortest trip (sync_clock). The error is at most half that round trip, which
// the trace records ("clock" in otherData). write_trace measures again, and between the two the
// offset is interpolated linearly (clocks of two nodes drift apart by parts per million: a
// millisecond in a quarter of an hour). Times are microseconds since rank 0's start.
//
// On CUDA the compute spans are CUDA events on the current stream (read back when the trace
// is written, so nothing synchronises during the run; the device's timer is put on the host's
// clock by two anchors, at the start and when the trace is written: "device_clock" in
// otherData) and the memory counter is the caching allocator's. That counter is read on the
// host, which runs ahead of the GPU, but drawn at the span's device end time: on a GPU it may
// lead the compute it is drawn against by as much as the host is ahead (often milliseconds). A
// comm span starts at an event recorded on the current stream when the call is made (NCCL's
// stream waits for it: the collective starts no earlier) and ends when a watcher
// thread sees the Work complete (isCompleted, which on NCCL queries the operation's end event;
// wait() returns at once on NCCL, so it does not end the span). The ops of a group
// (startCoalescing .. endCoalescing, dtc::batch_isend_irecv), which on NCCL have no Work of their
// own, are one "group" span with the ops in its args. On gloo a collective ends when its future
// completes; a send or receive, which has none, when wait() returns ("end": "wait" in its args,
// which scripts/trace_svg.py draws faint: the bar is an upper bound on the transfer).
//
// Each comm span also records when wait() was first called on its Work ("wait_us", on the
// trace's clock), so a test can tell a collective that ran beside the compute from one that was
// waited for as soon as it was issued.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dtc/compat.h"
#include "dtc/observe.h"

namespace dtc {

/// The tracks of a rank, as trace "tid"s.
enum class TraceTrack : int { kCompute = 0, kComm = 1, kMemory = 2 };

/// A time on a rank's trace: the host's steady clock, and on CUDA an event on the stream that
/// was current (its device time replaces the host's when the trace is written).
struct TraceTime {
  std::chrono::steady_clock::time_point host;
  std::shared_ptr<void> event;  ///< a CUDA event (cudaEvent_t), or null
  uint32_t base = 0;            ///< CUDA: the base event it is timed from (Tracer::now)
};

/// The offset of this rank's steady clock from rank 0's (sync_clock).
struct ClockSync {
  int64_t offset_ns = 0;  ///< add to this rank's steady clock to get rank 0's
  int64_t rtt_ns = 0;     ///< the shortest round trip through the store (error <= rtt / 2)
  int64_t origin_ns = 0;  ///< rank 0's steady clock at its start: time 0 of the trace
  int64_t local_ns = 0;   ///< this rank's steady clock when it was measured
  int rounds = 0;
};

/// One rank's timeline (thread-safe: backward hooks and communication threads record too).
class Tracer {
 public:
  using Clock = std::chrono::steady_clock;

  /// @param rank the process id in the trace
  /// @param device where compute runs: CUDA spans come from events on its current stream
  explicit Tracer(int rank = 0, torch::Device device = torch::kCPU);
  /// @param rank the process id in the trace
  /// @param device where compute runs
  /// @param watch end comm spans by a watcher thread polling isCompleted(), as on CUDA (the
  ///        default there), also off CUDA (tests run the CUDA path's watcher on gloo this way)
  Tracer(int rank, torch::Device device, bool watch);
  ~Tracer();
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  int rank() const { return rank_; }
  const torch::Device& device() const { return device_; }
  /// Puts this rank on rank 0's clock (sync_clock's result); the default: its own clock.
  void set_clock(const ClockSync& clock);
  /// A second measurement, later (write_trace makes one): between the two, the offset is
  /// interpolated linearly, so that clocks that drift apart (two nodes' oscillators, some
  /// parts per million) stay aligned over a long run.
  void set_end_clock(const ClockSync& clock);
  const ClockSync& clock() const { return clock_; }

  /// Now, on the host clock, and on CUDA an event recorded on the current stream.
  TraceTime now() const;
  /// Records a complete span [@p begin, @p end] on @p track; returns its index.
  size_t span(std::string name, const char* cat, TraceTrack track, const TraceTime& begin,
              const TraceTime& end, nlohmann::json args = nlohmann::json::object());
  /// Records that wait() was first called, at @p t, on the Work of the comm span @p index.
  void set_wait(size_t index, const TraceTime& t);
  /// Records a reading of the memory counter at @p t.
  void memory(const TraceTime& t);
  /// Records on @p tracer a comm span from @p issued to when @p work completes (on CUDA: the
  /// watcher sees it; on gloo: its future completes, or a wait() on it returns). Returns the
  /// Work to hand out, which also records the first wait(). The span holds the tracer weakly
  /// (a watched one, which only the tracer's own watcher ends, by a plain pointer).
  static c10::intrusive_ptr<c10d::Work> comm(const std::shared_ptr<Tracer>& tracer,
                                             c10::intrusive_ptr<c10d::Work> work,
                                             nlohmann::json args, const char* op,
                                             const TraceTime& issued);

  /// The rank's Chrome trace: {"traceEvents": [...], "otherData": {...}}. Waits for the CUDA
  /// events; a comm span still open (its Work neither completed nor waited for) is left out.
  nlohmann::json to_json() const;
  /// How many spans and counter readings have been recorded.
  size_t size() const;

 private:
  class CommWatch;
  struct Record {
    std::string name;
    const char* cat;
    TraceTrack track;
    TraceTime begin, end;
    nlohmann::json args;
    int64_t counter = -1;  // >= 0: a memory reading at `begin`
    bool waited = false;   // comm: wait() was called, at `wait`
    TraceTime wait{};
  };
  struct DeviceClock {  // CUDA: the base events, their device times, and the timer's rate
    std::vector<std::shared_ptr<void>> bases;
    std::vector<double> base_ms;  // from the first, NaN where unknown
    double scale = 1.0;           // host ms per device ms, from a second anchor (to_json)
    double anchor_error_us = 0;   // half the second anchor's round trip
  };
  // since the origin, on rank 0's clock, in us
  double micros(const TraceTime& t, const DeviceClock& device) const;
  double host_micros(int64_t ns) const;  // a host time, ns, likewise

  int rank_;
  torch::Device device_;
  ClockSync clock_, end_clock_;
  bool has_end_clock_ = false;
  TraceTime base_;  // the clock's origin on this rank; on CUDA, the event that device times use
  mutable std::mutex base_mu_;
  mutable std::vector<std::shared_ptr<void>> bases_;  // CUDA: base_.event, then one per second
  mutable Clock::time_point last_base_{};
  mutable std::mutex mu_;
  std::vector<Record> records_;
  std::unique_ptr<CommWatch> watch_;
};

/// This thread's tracer, or null when tracing is off (ranks as threads each set their own).
Tracer* active_tracer();

/// Makes @p tracer this thread's active tracer for its scope (null: none), then restores the
/// previous one.
class TraceScope {
 public:
  explicit TraceScope(Tracer* tracer);
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  Tracer* previous_;
};

/// A compute span for its scope on the active tracer: "{name}", or "{name} {index}" for an
/// index >= 0 ("{name}{index}" when the name is one letter: F3, B3, the papers' labels).
/// Costs one thread-local read when tracing is off; builds its name only when on.
class TraceSpan {
 public:
  explicit TraceSpan(const char* name, int64_t index = -1, const char* cat = "compute");
  ~TraceSpan();
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  Tracer* tracer_;
  const char* name_;
  int64_t index_;
  const char* cat_;
  TraceTime begin_;
};

/// Traces the backward of the region that turned @p input into @p output: a span "{name}"
/// ("{name} {index}") from when @p output's gradient arrives to when @p input's is complete,
/// recorded by gradient hooks, so from outside whatever code runs the backward. Call it in the
/// forward, after the region; nothing happens when tracing is off or no gradient will flow
/// (an input without requires_grad, e.g. token ids, ends the span when the backward reaches
/// the first tensor that has one: pass that one).
void trace_backward(const torch::Tensor& input, const torch::Tensor& output, const char* name,
                    int64_t index = -1);

/// Custom autograd Functions: their backward runs on autograd's threads (one per device on
/// CUDA), where this thread's tracer is not active. Call save_tracer(ctx) in forward and open
/// a TraceScope(saved_tracer(ctx)) in backward, so that spans placed in backward are recorded.
void save_tracer(torch::autograd::AutogradContext* ctx);
/// The tracer that was active when save_tracer(@p ctx) was called (null: none).
Tracer* saved_tracer(torch::autograd::AutogradContext* ctx);

/// A Comm that forwards every call to @p inner and records it on a Tracer's comm track, from
/// issue to completion, with the operation, the @p group's name, this rank's bytes, and the
/// peer and tag of a send or receive. @p ranks: the group's global ranks in its own rank order
/// (a subgroup's); each span then carries them ("ranks"), and a send or receive its peer's
/// global rank too ("peer_rank"), so that a reader tells two groups of one name apart and
/// pairs sends with receives across groups. Empty: the world, whose ranks are global. "bytes"
/// is this rank's input (a receive's: the bytes received); "wire_bytes" what it sends in NCCL's
/// ring algorithms (nccl-tests' bus factors: an allreduce 2(n-1)/n of it, an all-gather n - 1
/// inputs, a receive nothing), the figure to set against a link's bandwidth. The operations of a
/// group (start/endCoalescing) whose calls return no Work (NCCL on 2.x) are one span "group" from
/// startCoalescing to the group's completion, with "ops" (each op, bytes, peer, tag) and their
/// bytes in its args. One thread issues a group at a time, as c10d requires.
class TracingComm : public ForwardingComm {
 public:
  TracingComm(c10::intrusive_ptr<Comm> inner, std::shared_ptr<Tracer> tracer, std::string group,
              std::vector<int> ranks = {});

#if TORCH_VERSION_MAJOR >= 2
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
#endif

 protected:
  c10::intrusive_ptr<c10d::Work> call(
      const char* op, int64_t bytes, int peer, int tag,
      const std::function<c10::intrusive_ptr<c10d::Work>()>& issue) override;

 private:
  std::shared_ptr<Tracer> tracer_;
  std::string group_;
  std::vector<int> ranks_;  // the group's global ranks; empty: the world
  bool grouping_ = false;   // between startCoalescing and endCoalescing
  TraceTime group_issued_;
  nlohmann::json group_ops_ = nlohmann::json::array();
  int64_t group_bytes_ = 0;
  int64_t group_wire_bytes_ = 0;
};

/// Measures this rank's clock offset from rank 0's through @p store (see the top of this
/// file): every rank calls it at once, rank 0 answers each other rank's @p rounds pings.
/// @param now this rank's clock (tests pass a shifted one)
/// @param round names the measurement, so that a job can measure again ("start": the first,
///        which also shares rank 0's origin; write_trace measures "end")
ClockSync sync_clock(c10d::Store& store, int rank, int world, int rounds = 8,
                     const std::function<Tracer::Clock::time_point()>& now = Tracer::Clock::now,
                     const std::string& round = "start");

/// Writes @p tracer's trace to DIR/rank{r}.json and, on rank 0, the merged DIR/trace.json with
/// every rank's events (they travel through @p store, so DIR need not be shared between nodes;
/// store null: one rank). Every rank calls it; with a store it first measures the clocks again
/// (Tracer::set_end_clock). Returns the merged file's path on rank 0, else "".
std::string write_trace(Tracer& tracer, c10d::Store* store, int world, const std::string& dir);

// ---------------------------------------------------------------------------------------------
// Reading a trace (tests, and the checks the lessons' pictures make)
// ---------------------------------------------------------------------------------------------

/// One complete span of a trace.
struct TracedSpan {
  std::string name, cat;
  int rank = 0;
  TraceTrack track = TraceTrack::kCompute;
  double begin_us = 0, end_us = 0;
  nlohmann::json args;
};

/// The complete spans of a Chrome trace (one rank's or a merged one), sorted by begin time.
std::vector<TracedSpan> traced_spans(const nlohmann::json& trace);
/// The spans of @p rank on @p track whose name starts with @p prefix (any rank: -1).
std::vector<TracedSpan> select_spans(const std::vector<TracedSpan>& spans, int rank,
                                     TraceTrack track, const std::string& prefix = "");

}  // namespace dtc
