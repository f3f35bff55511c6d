// The timeline writer (dtc/trace.h): spans from the course's code and from gradient hooks, the
// comm track, one clock across ranks, and the per-rank and merged files, checked against what the
// test itself does (its own sleeps, shifted clocks and messages).
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <thread>

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

TEST(Trace, SpanLastsWhatItsScopeLasted) {
  Tracer tracer;
  {
    TraceScope scope(&tracer);
    TraceSpan span("sleep", 3);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const auto spans = traced_spans(tracer.to_json());
  ASSERT_EQ(spans.size(), 1u);
  EXPECT_EQ(spans[0].name, "sleep 3");
  EXPECT_GE(spans[0].end_us - spans[0].begin_us, 20e3);
  EXPECT_LT(spans[0].end_us - spans[0].begin_us, 20e3 + 50e3);
}

TEST(Trace, MemoryTrackReadsTheCountingAllocatorAtEachSpansEnd) {
  // Between two spans' ends the test keeps one more 4 MiB tensor: the counter rises by exactly
  // its bytes (the counting allocator sees tensor storage only; the spans allocate none).
  install_counting_allocator();
  // Earlier tests' gloo threads may still drop buffers for a few ms (lesson 10's 20 ms settle).
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
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
  EXPECT_EQ(readings[1] - readings[0], int64_t{4} << 20);
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
  // Rank 1 posts its receive, rank 0 sends 30 ms later: on one clock, the receive's span begins
  // before the send's and ends after the send began.
  std::vector<nlohmann::json> traces(2);
  run_ranks(
      2,
      [&](RankContext& ctx) {
        auto tracer = std::make_shared<Tracer>(ctx.rank);
        tracer->set_clock(sync_clock(*ctx.store, ctx.rank, ctx.world));
        TracingComm comm(ctx.comm, tracer, "world");
        std::vector<at::Tensor> t{torch::ones({256})};  // 1 KiB
        if (ctx.rank == 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(30));
          comm.send(t, 1, 7)->wait();
        } else {
          comm.recv(t, 0, 7)->wait();
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
  EXPECT_GE(recv[0].end_us - recv[0].begin_us, 20e3);  // it waited for the late send
  for (const auto& spans : {s0, s1}) {
    const auto ar = select_spans(spans, -1, TraceTrack::kComm, "allreduce");
    ASSERT_EQ(ar.size(), 1u);
    EXPECT_EQ(ar[0].args.value("bytes", 0), 1024);
    EXPECT_GE(ar[0].end_us, ar[0].begin_us);
  }
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
