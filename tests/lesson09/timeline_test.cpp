// Lesson 09's timelines (README section 9's pictures), read back from traces: the claims the
// pictures make, checked on timestamps, from outside the schedule and the executor. Each
// thread-rank records its own trace (dtc/trace.h): the given Stage::forward's micro-batch spans
// F<i> and, watched through autograd (a hook where a backward pass starts, the engine's
// callback where it ends), B<i>, or I<i> and W<i> for a split backward; a micro-batch is held by
// a stage from the end of its F to the end of its B (or W).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dtc/data.h"
#include "dtc/ranks.h"
#include "dtc/trace.h"
#include "dtc_test.h"
#include "pipeline.h"
#include "program.h"

namespace dtc::l09 {
namespace {

constexpr std::chrono::milliseconds kTraceTimeout{5000};
constexpr int kStages = 4;
constexpr int64_t kMicro = 8;

// One traced step of @p schedule on @p stages thread-ranks (4), m = @p micro (8), @p chunks per
// rank, one block each: each stage's compute spans (and its messages, with @p with_comm).
std::vector<std::vector<TracedSpan>> traced_step(ScheduleKind schedule, int chunks = 1,
                                                 int stages = kStages, int64_t micro = kMicro,
                                                 bool with_comm = false) {
  GptConfig model;
  model.layers = int64_t{stages} * chunks;
  model.hidden = 32;
  model.heads = 2;
  model.ctx = 16;
  model.tied = false;
  std::vector<std::vector<TracedSpan>> spans(static_cast<size_t>(stages));
  run_ranks(
      stages,
      [&](RankContext& ctx) {
        Gpt full(model);
        init_weights(full, 1);
        std::vector<Stage> stage = make_chunks(full, stages, chunks, ctx.rank);
        const Batch batch = ByteDataset::builtin().batch(1, 0, 2 * micro, model.ctx);
        const auto ops = make_schedule(schedule, stages, micro, ctx.rank, chunks);
        auto tracer = std::make_shared<Tracer>(ctx.rank);
        tracer->set_clock(sync_clock(*ctx.store, ctx.rank, ctx.world));
        auto comm = c10::make_intrusive<TracingComm>(ctx.comm, tracer, "pipeline");
        {
          TraceScope scope(tracer.get());
          for (auto& c : stage) c.begin_step();
          run_schedule(stage, *comm, ops, batch, micro);
        }
        const auto all = traced_spans(tracer->to_json());
        auto& mine = spans[static_cast<size_t>(ctx.rank)];
        mine = select_spans(all, ctx.rank, TraceTrack::kCompute);
        if (with_comm) {
          const auto comm_spans = select_spans(all, ctx.rank, TraceTrack::kComm);
          mine.insert(mine.end(), comm_spans.begin(), comm_spans.end());
        }
      },
      kTraceTimeout);
  return spans;
}

// The most micro-batches a stage held at once: +1 at each F<i>'s end, -1 at each B<i>'s end.
int64_t most_held(const std::vector<TracedSpan>& spans, int64_t* forwards, int64_t* backwards) {
  const std::regex micro("^([FB])[0-9]+$");
  std::vector<std::pair<double, int>> changes;
  *forwards = *backwards = 0;
  for (const auto& s : spans) {
    std::smatch m;
    if (!std::regex_match(s.name, m, micro)) continue;
    const bool forward = m[1] == "F";
    (forward ? *forwards : *backwards) += 1;
    changes.emplace_back(s.end_us, forward ? 1 : -1);
  }
  std::sort(changes.begin(), changes.end());  // at one instant, a release (-1) before a hold
  int64_t held = 0, most = 0;
  for (const auto& [t, d] : changes) most = std::max(most, held += d);
  return most;
}

TEST(L09Timeline, OneFOneBNeverHoldsMoreThanPMinusSMicroBatches) {
  // The 1F1B picture: stage s runs p - s - 1 warm-up forwards, then alternates, so it never
  // holds more than p - s micro-batches (PipeDream-Flush, Narayanan et al. 2021, Figure 4).
  const auto spans = traced_step(ScheduleKind::k1f1b);
  for (int s = 0; s < kStages; ++s) {
    SCOPED_TRACE(fmt::format("stage {}", s));
    int64_t forwards = 0, backwards = 0;
    const int64_t most = most_held(spans[static_cast<size_t>(s)], &forwards, &backwards);
    EXPECT_EQ(forwards, kMicro) << "one F<i> span per micro-batch";
    EXPECT_EQ(backwards, kMicro) << "one B<i> span per micro-batch";
    EXPECT_EQ(most, kStages - s) << "micro-batches held at once on the timeline";
  }
}

TEST(L09Timeline, GpipeHoldsEveryMicroBatchBeforeTheFirstBackward) {
  // The GPipe picture: every forward, then every backward; each stage holds all m.
  const auto spans = traced_step(ScheduleKind::kGpipe);
  for (int s = 0; s < kStages; ++s) {
    SCOPED_TRACE(fmt::format("stage {}", s));
    int64_t forwards = 0, backwards = 0;
    EXPECT_EQ(most_held(spans[static_cast<size_t>(s)], &forwards, &backwards), kMicro);
    EXPECT_EQ(forwards, kMicro);
    EXPECT_EQ(backwards, kMicro);
  }
}

TEST(L09Timeline, OneFOneBStartsBackwardBeforeTheLastForward) {
  // What makes the pictures differ: on stage 0, 1F1B's B0 runs before F(m-1); GPipe's does not.
  auto find = [](const std::vector<TracedSpan>& spans, const std::string& name) {
    for (const auto& s : spans)
      if (s.name == name) return s;
    throw std::runtime_error("no span " + name + " on stage 0");
  };
  const auto last = fmt::format("F{}", kMicro - 1);
  const auto one = traced_step(ScheduleKind::k1f1b);
  EXPECT_LT(find(one[0], "B0").end_us, find(one[0], last).begin_us);
  const auto gpipe = traced_step(ScheduleKind::kGpipe);
  EXPECT_GT(find(gpipe[0], "B0").begin_us, find(gpipe[0], last).end_us);
}

// Interleaved 1F1B's bubble is (p - 1)/(v m + p - 1) of the window when each chunk's forward
// takes 1 and its backward 2 (Narayanan et al. 2021, section 2.2.2): p - 1 slots of a chunk,
// not of a stage. The order alone gives it (L09TimelineOrder checks the order); the executor's
// exchanges can take it back, each group waiting for a message the schedule does not need yet
// (a backward's gradient not received with its pair's forward, a send held a pair longer):
// the values and the order stay right, the bubble is 1F1B's. Read from the trace, outside the
// executor: each stage's passes in order, and before each pass the sends and receives whose
// wait ended just before it began. Replayed on a clock where F = 1, B = 2 and a message is
// free but completes only once both sides have posted it (NCCL's rule; gloo's matching is
// looser), each pass starts when its stage is free and, for each of those messages, when the
// neighbour has run the pass after which it posted its side.
struct ReplayPass {
  bool forward = true;
  double end = 0;                             // the pass's end on the trace
  std::vector<std::pair<int, size_t>> waits;  // (stage, pass) it waited for, via messages
};

std::vector<double> unit_clock_bubbles(const std::vector<std::vector<TracedSpan>>& spans) {
  const std::regex pass("^[0-9]*([FB])[0-9]+$");
  const size_t p = spans.size();
  std::vector<std::vector<ReplayPass>> passes(p);
  std::vector<std::vector<double>> begins(p);
  struct Msg {
    bool send;
    int peer;
    int64_t tag;
    double post, done;
  };
  std::vector<std::vector<Msg>> msgs(p);
  for (size_t r = 0; r < p; ++r) {
    for (const auto& s : spans[r]) {
      std::smatch m;
      if (s.track == TraceTrack::kCompute && std::regex_match(s.name, m, pass)) {
        passes[r].push_back({m[1] == "F", s.end_us, {}});
        begins[r].push_back(s.begin_us);
      } else if (s.track == TraceTrack::kComm && (s.name == "send" || s.name == "recv")) {
        msgs[r].push_back({s.name == "send", s.args.value("peer", -1),
                           s.args.value("tag", int64_t{-1}), s.begin_us, s.end_us});
      }
    }
  }
  // The pass of stage r that ended last before time t (its messages are posted after it).
  auto before = [&](size_t r, double t) -> std::optional<size_t> {
    std::optional<size_t> last;
    for (size_t k = 0; k < passes[r].size(); ++k)
      if (passes[r][k].end <= t + 1.0) last = k;
    return last;
  };
  for (size_t r = 0; r < p; ++r) {
    std::map<std::tuple<bool, int, int64_t>, int> seen;  // the k-th send r -> q with tag t ...
    for (const Msg& msg : msgs[r]) {
      const int nth = seen[{msg.send, msg.peer, msg.tag}]++;
      size_t waiter = 0;
      while (waiter < begins[r].size() && begins[r][waiter] < msg.done - 1.0) ++waiter;
      if (waiter == begins[r].size() || msg.peer < 0 || msg.peer >= static_cast<int>(p)) continue;
      int k = 0;  // ... meets the k-th receive on q from r with tag t
      for (const Msg& other : msgs[static_cast<size_t>(msg.peer)]) {
        if (other.send == msg.send || other.peer != static_cast<int>(r) || other.tag != msg.tag)
          continue;
        if (k++ == nth) {
          if (auto j = before(static_cast<size_t>(msg.peer), other.post)) {
            passes[r][waiter].waits.emplace_back(msg.peer, *j);
          }
          break;
        }
      }
    }
  }
  std::vector<std::vector<double>> end(p);
  std::vector<double> busy(p, 0.0);
  for (bool moved = true; moved;) {
    moved = false;
    for (size_t r = 0; r < p; ++r) {
      const size_t k = end[r].size();
      if (k == passes[r].size()) continue;
      double start = k ? end[r][k - 1] : 0.0;
      bool ready = true;
      for (const auto& [q, j] : passes[r][k].waits) {
        if (j >= end[static_cast<size_t>(q)].size()) {
          ready = false;
          break;
        }
        start = std::max(start, end[static_cast<size_t>(q)][j]);
      }
      if (!ready) continue;
      const double d = passes[r][k].forward ? 1.0 : 2.0;
      end[r].push_back(start + d);
      busy[r] += d;
      moved = true;
    }
  }
  double window = 0;
  for (size_t r = 0; r < p; ++r) {
    if (end[r].size() != passes[r].size()) {
      ADD_FAILURE() << "the replay waits in a circle at stage " << r << "'s pass " << end[r].size();
      return {};
    }
    if (!end[r].empty()) window = std::max(window, end[r].back());
  }
  std::vector<double> bubbles;
  for (size_t r = 0; r < p; ++r) bubbles.push_back(1.0 - busy[r] / window);
  return bubbles;
}

TEST(L09Timeline, InterleavedExchangesKeepTheBubbleOfAChunk) {
  // 3 and 4 pairs in the steady state, a rank with none (4 x 4), and 2, 3 and 4 ranks
  for (const auto& [stages, micro] : {std::pair{2, int64_t{8}}, std::pair{3, int64_t{9}},
                                      std::pair{4, int64_t{4}}, std::pair{4, int64_t{8}}}) {
    constexpr int kChunks = 2;
    SCOPED_TRACE(fmt::format("{} stages x {} chunks, m = {}", stages, kChunks, micro));
    const auto spans = traced_step(ScheduleKind::kInterleaved, kChunks, stages, micro, true);
    const double want = (stages - 1.0) / (kChunks * micro + stages - 1.0);
    const auto bubbles = unit_clock_bubbles(spans);
    ASSERT_EQ(bubbles.size(), static_cast<size_t>(stages));
    for (int s = 0; s < stages; ++s) {
      EXPECT_NEAR(bubbles[static_cast<size_t>(s)], want, 1e-9)
          << "stage " << s << " idles this much of the window with F = 1, B = 2 and free "
          << "messages; 1F1B's (p-1)/(m+p-1) is " << (stages - 1.0) / (micro + stages - 1.0)
          << ". Which message did a group wait for before the schedule needed it? (README "
          << "section 7: the exchanges)";
    }
  }
}

// What a stage's trace should show for @p ops: the given Stage::forward names each forward
// "F<i>" and each backward pass through micro-batch i's graph "B<i>", or "I<i>" then "W<i>" when
// it is split ("<c>F<i>" and so on with several chunks). The first stage's input is the tokens:
// its I computes nothing (no pass, no span), and its W, the first pass through that graph, is
// the whole backward: "B<i>".
std::vector<std::string> expected_names(const std::vector<Op>& ops, int chunks, bool first) {
  std::vector<std::string> names;
  for (const Op& op : ops) {
    const bool embed = first && op.chunk == 0;
    char kind = "FBIW"[op.kind];
    if (embed && op.kind == Op::kInput) continue;
    if (embed && op.kind == Op::kWeight) kind = 'B';
    names.push_back(
        fmt::format("{}{}{}", chunks > 1 ? std::to_string(op.chunk) : "", kind, op.micro));
  }
  return names;
}

// Every schedule, on the trace of the executor running it: each stage's forward and backward
// passes in the schedule's order, and no more micro-batches held at once than the schedule
// holds (max_in_flight, given: a micro-batch is held from its forward to its B, or its W).
struct TimelineCase {
  ScheduleKind schedule;
  int chunks;
};

class L09TimelineOrder : public ::testing::TestWithParam<TimelineCase> {};

TEST_P(L09TimelineOrder, EveryStageRunsTheScheduleInOrder) {
  const TimelineCase c = GetParam();
  const auto spans = traced_step(c.schedule, c.chunks);
  const std::regex pass("^([0-9]*)([FBIW])([0-9]+)$");
  for (int s = 0; s < kStages; ++s) {
    SCOPED_TRACE(fmt::format("stage {}", s));
    const auto ops = make_schedule(c.schedule, kStages, kMicro, s, c.chunks);
    std::vector<std::pair<double, std::string>> begun;
    std::vector<std::pair<double, int>> changes;
    for (const auto& span : spans[static_cast<size_t>(s)]) {
      std::smatch m;
      if (!std::regex_match(span.name, m, pass)) continue;
      begun.emplace_back(span.begin_us, span.name);
      if (m[2] == "F") changes.emplace_back(span.end_us, 1);
      if (m[2] == "B" || m[2] == "W") changes.emplace_back(span.end_us, -1);
    }
    std::sort(begun.begin(), begun.end());
    std::vector<std::string> order;
    for (const auto& b : begun) order.push_back(b.second);
    EXPECT_EQ(fmt::format("{}", fmt::join(order, " ")),
              fmt::format("{}", fmt::join(expected_names(ops, c.chunks, s == 0), " ")))
        << "the passes on the trace, in the order they began, against the schedule";
    std::sort(changes.begin(), changes.end());
    int64_t held = 0, most = 0;
    for (const auto& [t, d] : changes) most = std::max(most, held += d);
    EXPECT_EQ(most, max_in_flight(ops)) << "micro-batches (of all chunks) held at once";
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, L09TimelineOrder,
                         ::testing::Values(TimelineCase{ScheduleKind::kGpipe, 1},
                                           TimelineCase{ScheduleKind::k1f1b, 1},
                                           TimelineCase{ScheduleKind::kInterleaved, 2},
                                           TimelineCase{ScheduleKind::kZbH1, 1}),
                         [](const auto& info) {
                           std::string name = schedule_name(info.param.schedule);
                           name.erase(std::remove(name.begin(), name.end(), '-'), name.end());
                           return name;
                         });

}  // namespace
}  // namespace dtc::l09
