// The timeline writer (dtc/trace.h): spans from the course's code and from gradient hooks, the
// comm track, one clock across ranks, and the per-rank and merged files, checked against what the
// test itself does (its own sleeps, shifted clocks and messages).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <thread>

#include "dtc/dist.h"
#include "dtc/memory.h"
#include "dtc/model.h"
#include "dtc/ranks.h"
#include "dtc/trace.h"
#include "dtc_test.h"

namespace dtc {
namespace {

using test::kTimeout;

GptConfig two_blocks() {
  GptConfig c;
  c.layers = 2;
  c.hidden = 32;
  c.heads = 2;
  c.ctx = 8;
  return c;
}

TEST(Trace, OffRecordsNothing) {
  Tracer tracer;  // made, but not this thread's active tracer
  Gpt model = make_gpt(two_blocks(), 1, torch::kCPU);
  {
    TraceSpan span("forward");
    model->forward(torch::zeros({2, 8}, torch::kLong)).sum().backward();
  }
  EXPECT_EQ(active_tracer(), nullptr);
  EXPECT_EQ(tracer.size(), 0u);
}

TEST(Trace, BlockSpansNestInOrderForwardThenBackwardInReverse) {
  Tracer tracer;
  Gpt model = make_gpt(two_blocks(), 1, torch::kCPU);
  {
    TraceScope scope(&tracer);
    torch::Tensor loss;
    {
      TraceSpan span("forward");
      loss = model->forward(torch::zeros({2, 8}, torch::kLong)).sum();
    }
    TraceSpan span("backward");
    loss.backward();
  }
  EXPECT_EQ(active_tracer(), nullptr);  // the scope restored "off"
  const auto spans = traced_spans(tracer.to_json());
  std::vector<std::string> names;
  for (const auto& s : spans) names.push_back(s.name);
  const std::vector<std::string> want{"forward",  "fwd block 0", "fwd block 1", "fwd head",
                                      "backward", "bwd head",    "bwd block 1", "bwd block 0"};
  EXPECT_EQ(names, want);
  const auto outer = [&](const std::string& name) {
    for (const auto& s : spans)
      if (s.name == name) return s;
    throw std::runtime_error("no span " + name);
  };
  for (const auto& s : spans) {
    const auto& parent = outer(s.name.rfind("fwd", 0) == 0 ? "forward" : "backward");
    if (s.name == "forward" || s.name == "backward") continue;
    EXPECT_GE(s.begin_us, parent.begin_us) << s.name;
    EXPECT_LE(s.end_us, parent.end_us) << s.name;
  }
  // The backward spans follow each other (block 1's ends where block 0's may start).
  EXPECT_LE(outer("bwd head").end_us, outer("bwd block 1").begin_us);
  EXPECT_LE(outer("bwd block 1").end_us, outer("bwd block 0").begin_us);
}

TEST(Trace, ComputeSpansNestWithinTheSlackAndAreLeftCrossingBeyondIt) {
  // Two hooks a microsecond apart make spans cross by that much: the later one is moved, and
  // says by how much. Spans that cross by milliseconds are in the wrong place: left as they are.
  Tracer tracer;
  const auto t0 = Tracer::Clock::now();
  const auto at = [&](double ms) {
    return TraceTime{t0 + std::chrono::duration_cast<Tracer::Clock::duration>(
                              std::chrono::duration<double, std::milli>(ms)),
                     nullptr};
  };
  tracer.span("a", "compute", TraceTrack::kCompute, at(0), at(10));
  tracer.span("b", "compute", TraceTrack::kCompute, at(10 - 0.001), at(20));  // 1 us early
  tracer.span("c", "compute", TraceTrack::kCompute, at(30), at(50));
  tracer.span("d", "compute", TraceTrack::kCompute, at(38), at(60));  // 8 ms inside c
  const auto spans = traced_spans(tracer.to_json());
  ASSERT_EQ(spans.size(), 4u);
  const auto& a = spans[0];
  const auto& b = spans[1];
  const auto& c = spans[2];
  const auto& d = spans[3];
  EXPECT_EQ(b.name, "b");
  EXPECT_DOUBLE_EQ(b.begin_us, a.end_us);  // starts where a ends
  EXPECT_NEAR(b.args.value("nest_shift_us", 0.0), 1.0, 0.01);
  EXPECT_NEAR(b.end_us - a.begin_us, 20e3, 0.01);  // its end stays
  EXPECT_EQ(d.name, "d");
  EXPECT_NEAR(d.begin_us - c.begin_us, 8e3, 0.01);  // still crossing c
  EXPECT_FALSE(d.args.contains("nest_shift_us"));
}

TEST(Trace, SpanLastsWhatItsScopeLasted) {
  // At least the sleep inside the scope, at most what the test's own clock saw around it.
  Tracer tracer;
  const auto before = Tracer::Clock::now();
  {
    TraceScope scope(&tracer);
    TraceSpan span("sleep", 3);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const double outside =
      std::chrono::duration<double, std::micro>(Tracer::Clock::now() - before).count();
  const auto spans = traced_spans(tracer.to_json());
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].name, "sleep 3");
  EXPECT_GE(spans[0].end_us - spans[0].begin_us, 20e3);
  EXPECT_LE(spans[0].end_us - spans[0].begin_us, outside);
  EXPECT_GE(spans[0].begin_us, 0.0);  // after the tracer's origin
}

TEST(Trace, MemoryTrackReadsTheCountingAllocatorAtEachSpansEnd) {
  // Between two spans' ends the test keeps one more 4 MiB tensor: the counter rises by exactly
  // its bytes (the counting allocator sees tensor storage only; the spans allocate none).
  // The counter is the process's: another thread (an earlier case's gloo threads, which free
  // their buffers late) can allocate between the readings, so up to 5 tries; a counter that
  // read anything but the storage in use would never show exactly 4 MiB.
  install_counting_allocator();
  std::vector<int64_t> deltas;
  for (int attempt = 0; attempt < 5; ++attempt) {
    Tracer tracer;
    torch::Tensor kept;
    {
      TraceScope scope(&tracer);
      { TraceSpan a("before"); }
      kept = torch::empty({1 << 20}, torch::kFloat);
      { TraceSpan b("after"); }
    }
    std::vector<int64_t> readings;
    const nlohmann::json trace = tracer.to_json();
    for (const auto& e : trace["traceEvents"]) {
      if (e.value("ph", "") == "C") readings.push_back(e["args"]["bytes"].get<int64_t>());
    }
    ASSERT_EQ(readings.size(), 2u) << "one reading at the end of each span";
    deltas.push_back(readings[1] - readings[0]);
    if (deltas.back() == int64_t{4} << 20) break;
  }
  EXPECT_EQ(deltas.back(), int64_t{4} << 20) << "deltas seen: " << ::testing::PrintToString(deltas);
}

TEST(Trace, ClockOffsetIsMeasuredThroughTheStore) {
  // Rank r's clock runs r x 5 s ahead of rank 0's: sync_clock must find -r x 5 s, within half
  // the round trip it measured.
  std::vector<ClockSync> sync(3);
  run_ranks(
      3,
      [&](RankContext& ctx) {
        const auto shift = std::chrono::seconds(5 * ctx.rank);
        sync[static_cast<size_t>(ctx.rank)] = sync_clock(
            *ctx.store, ctx.rank, ctx.world, 8, [&] { return Tracer::Clock::now() + shift; });
      },
      kTimeout);
  EXPECT_EQ(sync[0].offset_ns, 0);
  for (int r = 1; r < 3; ++r) {
    const auto& s = sync[static_cast<size_t>(r)];
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(s.origin_ns, sync[0].origin_ns);
    EXPECT_GT(s.rtt_ns, 0);
    EXPECT_NEAR(static_cast<double>(s.offset_ns), -5e9 * r, s.rtt_ns / 2.0 + 1e3);
  }
}

TEST(Trace, CommSpansRunFromIssueToCompletionWithOpBytesPeerAndTag) {
  // Rank 1 posts its receive and then tells rank 0 through the store; rank 0 sends 20 ms after
  // it heard: on one clock, the receive's span begins before the send's and ends after the send
  // began, at least 20 ms after it began.
  std::vector<nlohmann::json> traces(2);
  run_ranks(
      2,
      [&](RankContext& ctx) {
        auto tracer = std::make_shared<Tracer>(ctx.rank);
        tracer->set_clock(sync_clock(*ctx.store, ctx.rank, ctx.world));
        TracingComm comm(ctx.comm, tracer, "world");
        std::vector<at::Tensor> t{torch::ones({256})};  // 1 KiB
        if (ctx.rank == 0) {
          ctx.store->get("posted");  // blocks until rank 1 has posted its receive
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          comm.send(t, 1, 7)->wait();
        } else {
          auto work = comm.recv(t, 0, 7);
          ctx.store->set("posted", std::vector<uint8_t>{1});
          work->wait();
        }
        comm.allreduce(t)->wait();
        traces[static_cast<size_t>(ctx.rank)] = tracer->to_json();
      },
      kTimeout);
  const auto s0 = traced_spans(traces[0]), s1 = traced_spans(traces[1]);
  const auto send = select_spans(s0, 0, TraceTrack::kComm, "send");
  const auto recv = select_spans(s1, 1, TraceTrack::kComm, "recv");
  ASSERT_EQ(send.size(), 1u);
  ASSERT_EQ(recv.size(), 1u);
  EXPECT_EQ(send[0].args.value("peer", -1), 1);
  EXPECT_EQ(send[0].args.value("tag", -1), 7);
  EXPECT_EQ(send[0].args.value("bytes", 0), 1024);
  EXPECT_EQ(send[0].args.value("group", ""), "world");
  EXPECT_EQ(recv[0].args.value("peer", -1), 0);
  EXPECT_LT(recv[0].begin_us, send[0].begin_us);
  EXPECT_GT(recv[0].end_us, send[0].begin_us);
  const double error = traces[1]["otherData"]["clock"]["rtt_us"].get<double>() / 2;
  EXPECT_GE(recv[0].end_us - recv[0].begin_us, 20e3);  // it waited for the late send (one clock)
  EXPECT_GE(recv[0].end_us, send[0].begin_us - error);
  // The receive was waited for once its span had begun, and its span ends where wait() returned.
  ASSERT_TRUE(recv[0].args.contains("wait_us"));
  EXPECT_GE(recv[0].args["wait_us"].get<double>(), recv[0].begin_us);
  EXPECT_LE(recv[0].args["wait_us"].get<double>(), recv[0].end_us);
  for (const auto& spans : {s0, s1}) {
    const auto ar = select_spans(spans, -1, TraceTrack::kComm, "allreduce");
    ASSERT_EQ(ar.size(), 1u);
    EXPECT_EQ(ar[0].args.value("bytes", 0), 1024);
    EXPECT_GE(ar[0].end_us, ar[0].begin_us);
  }
}

TEST(Trace, CommSpansRecordTheFirstWait) {
  // A collective that finished long before anyone waited: its span ends at completion (gloo's
  // future), and "wait_us" says when the test called wait(), 20 ms after issuing it.
  std::vector<nlohmann::json> traces(2);
  run_ranks(
      2,
      [&](RankContext& ctx) {
        auto tracer = std::make_shared<Tracer>(ctx.rank);
        TracingComm comm(ctx.comm, tracer, "world");
        std::vector<at::Tensor> t{torch::ones({64})};
        auto work = comm.allreduce(t);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        const auto waited = Tracer::Clock::now();
        work->wait();
        work->wait();  // the first wait is the one recorded
        auto never = comm.allreduce(t);
        never->getFuture()->wait();  // not through wait(): no "wait_us"
        // its span is recorded by a callback on the future, which may run just after wait()
        for (int i = 0; i < 2000 && tracer->size() < 2; ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        traces[static_cast<size_t>(ctx.rank)] = tracer->to_json();
        traces[static_cast<size_t>(ctx.rank)]["waited_us"] =
            std::chrono::duration<double, std::micro>(waited.time_since_epoch()).count() -
            static_cast<double>(tracer->clock().origin_ns) / 1e3;
      },
      kTimeout);
  for (const auto& trace : traces) {
    const auto ar = select_spans(traced_spans(trace), -1, TraceTrack::kComm, "allreduce");
    ASSERT_EQ(ar.size(), 2u);
    ASSERT_TRUE(ar[0].args.contains("wait_us"));
    const double wait = ar[0].args["wait_us"].get<double>();
    EXPECT_GE(wait - ar[0].begin_us, 20e3);
    EXPECT_GE(wait, trace["waited_us"].get<double>());
    EXPECT_LT(wait, trace["waited_us"].get<double>() + 20e3) << "the first wait, not the second";
    EXPECT_FALSE(ar[1].args.contains("wait_us"));
  }
}

#if TORCH_VERSION_MAJOR >= 2
// NCCL's groups, on gloo: inside startCoalescing .. endCoalescing an op returns no Work, and
// the group's one Work waits for them all.
class AllWork : public c10d::Work {
 public:
  explicit AllWork(std::vector<c10::intrusive_ptr<c10d::Work>> works) : works_(std::move(works)) {}
  bool isCompleted() override {
    return std::all_of(works_.begin(), works_.end(), [](auto& w) { return w->isCompleted(); });
  }
  bool wait(std::chrono::milliseconds timeout) override {
    for (auto& w : works_) w->wait(timeout);
    return true;
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

class GroupingComm : public ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override { grouping_ = true; }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    grouping_ = false;
    return c10::make_intrusive<AllWork>(std::move(pending_));
  }

 protected:
  c10::intrusive_ptr<c10d::Work> call(
      const char*, int64_t, int, int,
      const std::function<c10::intrusive_ptr<c10d::Work>()>& issue) override {
    auto work = issue();
    if (!grouping_) return work;
    pending_.push_back(std::move(work));
    return nullptr;
  }

 private:
  bool grouping_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> pending_;
};

TEST(Trace, TheWatcherEndsCommSpansAndTheTraceWaitsForIt) {
  // The CUDA path's watcher (isCompleted polled every 50 us), run on gloo: a collective's span
  // ends when the watcher sees it complete ("watch"), which may be after wait() returned; the
  // trace, taken right after, still has it. A tracer dropped with an operation still open goes
  // quietly (its watcher is joined), and the Work it handed out still completes.
  std::vector<nlohmann::json> traces(2);
  run_ranks(
      2,
      [&](RankContext& ctx) {
        auto tracer = std::make_shared<Tracer>(ctx.rank, torch::kCPU, /*watch=*/true);
        tracer->set_clock(sync_clock(*ctx.store, ctx.rank, ctx.world));
        auto comm = c10::make_intrusive<TracingComm>(ctx.comm, tracer, "world");
        std::vector<at::Tensor> t{torch::ones({256})};
        comm->allreduce(t)->wait();
        traces[static_cast<size_t>(ctx.rank)] = tracer->to_json();
        // rank 0 issues a second allreduce, drops its tracer, then tells rank 1 to join in
        if (ctx.rank == 0) {
          auto work = comm->allreduce(t);
          comm.reset();
          tracer.reset();  // joins the watcher while the operation is open
          ctx.store->set("dropped", std::vector<uint8_t>{1});
          work->wait();
        } else {
          ctx.store->get("dropped");
          comm->allreduce(t)->wait();
        }
        EXPECT_EQ(t[0][0].item<float>(), 4.0f) << "rank " << ctx.rank;
      },
      kTimeout);
  for (int r = 0; r < 2; ++r) {
    const auto ar = select_spans(traced_spans(traces[static_cast<size_t>(r)]), r, TraceTrack::kComm,
                                 "allreduce");
    ASSERT_EQ(ar.size(), 1u) << "rank " << r;
    EXPECT_EQ(ar[0].args.value("end", ""), "watch");
    EXPECT_GE(ar[0].end_us, ar[0].begin_us);
    EXPECT_GE(ar[0].args.value("wait_us", -1.0), ar[0].begin_us);
  }
}

TEST(Trace, ASubgroupsSpansNameItsGlobalRanksAndPeers) {
  // Two groups of one name, {0, 2} and {1, 3} (a cp group beside tp 2): each span carries its
  // group's global ranks, and a send or receive its peer's global rank besides the group-local
  // one, so that a reader of the merged trace pairs them (tests/support/e2e_run.py); and the
  // bytes it puts on the wire beside its input's.
  std::vector<nlohmann::json> traces(4);
  run_ranks(
      4,
      [&](RankContext& ctx) {
        auto tracer = std::make_shared<Tracer>(ctx.rank);
        const std::vector<int> members = {ctx.rank % 2, ctx.rank % 2 + 2};
        auto sub = new_subgroup(ctx.store, fmt::format("cp{}", ctx.rank % 2), members, ctx.rank,
                                BackendKind::kGloo, kTimeout);
        EXPECT_THROW(TracingComm(sub, tracer, "cp", {0, 1, 2}), std::invalid_argument)
            << "three ranks named for a group of two";
        auto comm = c10::make_intrusive<TracingComm>(sub, tracer, "cp", members);
        std::vector<at::Tensor> t{torch::ones({8})};
        comm->allreduce(t)->wait();
        const int peer = 1 - comm->getRank();
        if (comm->getRank() == 0) {
          comm->send(t, peer, 7)->wait();
        } else {
          comm->recv(t, peer, 7)->wait();
        }
        traces[static_cast<size_t>(ctx.rank)] = tracer->to_json();
      },
      kTimeout);
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE(r);
    const std::vector<int> members = {r % 2, r % 2 + 2};
    const auto spans = traced_spans(traces[static_cast<size_t>(r)]);
    const auto ar = select_spans(spans, r, TraceTrack::kComm, "allreduce");
    ASSERT_EQ(ar.size(), 1u);
    EXPECT_EQ(ar[0].args.at("ranks").get<std::vector<int>>(), members);
    EXPECT_FALSE(ar[0].args.contains("peer_rank")) << "a collective has no peer";
    EXPECT_EQ(ar[0].args.at("bytes").get<int64_t>(), 32) << "this rank's input: 8 floats";
    EXPECT_EQ(ar[0].args.at("wire_bytes").get<int64_t>(), 2 * 1 * 32 / 2)
        << "a ring allreduce over n = 2 sends 2(n-1)/n of the array (nccl-tests)";
    const auto p2p = select_spans(spans, r, TraceTrack::kComm, r < 2 ? "send" : "recv");
    ASSERT_EQ(p2p.size(), 1u);
    EXPECT_EQ(p2p[0].args.at("peer").get<int>(), r < 2 ? 1 : 0) << "the group-local rank";
    EXPECT_EQ(p2p[0].args.at("peer_rank").get<int>(), r < 2 ? r + 2 : r - 2) << "the global one";
    EXPECT_EQ(p2p[0].args.at("wire_bytes").get<int64_t>(), r < 2 ? 32 : 0)
        << "a send puts its bytes on the wire, a receive none";
  }
}

TEST(Trace, AGroupWhoseOpsHaveNoWorkIsOneSpanWithItsOps) {
  std::vector<nlohmann::json> traces(2);
  run_ranks(
      2,
      [&](RankContext& ctx) {
        auto tracer = std::make_shared<Tracer>(ctx.rank);
        auto comm = c10::make_intrusive<TracingComm>(c10::make_intrusive<GroupingComm>(ctx.comm),
                                                     tracer, "ring");
        const int peer = 1 - ctx.rank;
        auto out = torch::ones({256}), in = torch::empty({256});
        for (auto& w : batch_isend_irecv(
                 *comm, {{P2POp::kSend, out, peer, 3}, {P2POp::kRecv, in, peer, 3}})) {
          w->wait();
        }
        traces[static_cast<size_t>(ctx.rank)] = tracer->to_json();
      },
      kTimeout);
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const auto spans = traced_spans(traces[static_cast<size_t>(r)]);
    ASSERT_EQ(spans.size(), 1u) << "one span for the group, none for its ops";
    EXPECT_EQ(spans[0].name, "group");
    EXPECT_EQ(spans[0].args.value("group", ""), "ring");
    EXPECT_EQ(spans[0].args.value("bytes", 0), 2048);
    ASSERT_EQ(spans[0].args["ops"].size(), 2u);
    EXPECT_EQ(spans[0].args["ops"][0].value("op", ""), "send");
    EXPECT_EQ(spans[0].args["ops"][1].value("op", ""), "recv");
    EXPECT_EQ(spans[0].args["ops"][0].value("peer", -1), 1 - r);
    EXPECT_EQ(spans[0].args["ops"][1].value("tag", -1), 3);
  }
}
#endif

// A custom Function whose backward places a span, as lesson 10's ring attention does.
struct SpanInBackward : public torch::autograd::Function<SpanInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x) {
    save_tracer(ctx);
    return x * 2;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    TraceScope scope(saved_tracer(ctx));
    TraceSpan span("custom bwd");
    return {g[0] * 2};
  }
};

TEST(Trace, SpansInACustomBackwardAreRecordedOnAnyThread) {
  // On CUDA, backward runs on autograd's device threads, where no tracer is active: here the
  // backward runs on a thread of the test's, which has none either.
  Tracer tracer;
  auto x = torch::ones({4}, torch::requires_grad());
  torch::Tensor y;
  {
    TraceScope scope(&tracer);
    y = SpanInBackward::apply(x).sum();
  }
  std::thread([&] {
    ASSERT_EQ(active_tracer(), nullptr);
    y.backward();
  }).join();
  const auto spans = traced_spans(tracer.to_json());
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].name, "custom bwd");
  EXPECT_TRUE(torch::equal(x.grad(), torch::full({4}, 2.0)));
}

TEST(Trace, ADriftingClockIsInterpolatedBetweenTwoMeasurements) {
  // Rank 1's clock runs 5 s ahead and 5 % fast. Measured at the start and again 200 ms later,
  // a time in between maps to rank 0's clock within the round trips; with the start's offset
  // alone it would be 5 ms off.
  struct Seen {
    double traced_us = 0, true_us = 0, error_us = 0, start_only_us = 0;
  };
  Seen seen;
  run_ranks(
      2,
      [&](RankContext& ctx) {
        const auto start = Tracer::Clock::now();
        const double rate = ctx.rank == 1 ? 1.05 : 1.0;
        const auto shift = std::chrono::seconds(ctx.rank == 1 ? 5 : 0);
        auto shifted = [&](Tracer::Clock::time_point t) {
          return start + shift +
                 std::chrono::duration_cast<Tracer::Clock::duration>((t - start) * rate);
        };
        auto clock = [&] { return shifted(Tracer::Clock::now()); };
        const ClockSync first = sync_clock(*ctx.store, ctx.rank, ctx.world, 8, clock);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        const auto real = Tracer::Clock::now();  // one reading, seen on both clocks
        const auto local = shifted(real);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        const ClockSync last = sync_clock(*ctx.store, ctx.rank, ctx.world, 8, clock, "end");
        if (ctx.rank != 1) return;
        Tracer tracer(1);
        tracer.set_clock(first);
        tracer.set_end_clock(last);
        tracer.span("mid", "compute", TraceTrack::kCompute, TraceTime{local, nullptr},
                    TraceTime{local, nullptr});
        seen.traced_us = traced_spans(tracer.to_json()).at(0).begin_us;
        Tracer start_only(1);
        start_only.set_clock(first);
        start_only.span("mid", "compute", TraceTrack::kCompute, TraceTime{local, nullptr},
                        TraceTime{local, nullptr});
        seen.start_only_us = traced_spans(start_only.to_json()).at(0).begin_us;
        // rank 0's clock is the real one; its origin is rank 0's time at the first measurement
        seen.true_us = static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                               real.time_since_epoch())
                                               .count() -
                                           first.origin_ns) /
                       1e3;
        seen.error_us = static_cast<double>(std::max(first.rtt_ns, last.rtt_ns)) / 1e3;
      },
      kTimeout);
  EXPECT_GT(seen.true_us, 90e3);
  // The tolerance must be able to tell: well under the 5 ms the start's offset alone is off.
  ASSERT_LT(seen.error_us, 1000.0) << "round trips through the store too slow to tell";
  EXPECT_NEAR(seen.traced_us, seen.true_us, seen.error_us + 50.0);
  EXPECT_GT(std::abs(seen.start_only_us - seen.true_us), seen.error_us + 50.0)
      << "the start's offset alone would do: the test cannot tell interpolation from none";
}

TEST(Trace, WritesEachRankAndOneMergedFile) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("dtc-trace-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::vector<std::string> merged(2);
  run_ranks(
      2,
      [&](RankContext& ctx) {
        Tracer tracer(ctx.rank);
        tracer.set_clock(sync_clock(*ctx.store, ctx.rank, ctx.world));
        {
          TraceScope scope(&tracer);
          TraceSpan span("work", ctx.rank);
        }
        merged[static_cast<size_t>(ctx.rank)] =
            write_trace(tracer, ctx.store.get(), ctx.world, dir.string());
      },
      kTimeout);
  EXPECT_EQ(merged[0], (dir / "trace.json").string());
  EXPECT_EQ(merged[1], "");
  ASSERT_TRUE(std::filesystem::exists(dir / "rank0.json"));
  ASSERT_TRUE(std::filesystem::exists(dir / "rank1.json"));
  std::ifstream f(dir / "trace.json");
  const auto trace = nlohmann::json::parse(f);
  std::set<std::string> names;
  std::set<int> pids;
  for (const auto& s : traced_spans(trace)) {
    names.insert(s.name);
    pids.insert(s.rank);
  }
  EXPECT_EQ(names, (std::set<std::string>{"work 0", "work 1"}));
  EXPECT_EQ(pids, (std::set<int>{0, 1}));
  EXPECT_EQ(trace["otherData"]["ranks"].size(), 2u);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dtc
