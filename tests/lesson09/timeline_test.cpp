// Lesson 09's timelines (README section 9's pictures), read back from traces: the claims the
// GPipe and 1F1B pictures make, checked on timestamps, from outside the schedule and the
// executor. Each thread-rank records its own trace (dtc/trace.h): the given Stage::forward's
// micro-batch spans F<i> and, through gradient hooks, B<i>; a micro-batch is held by a stage
// from the end of its F to the end of its B.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <regex>
#include <string>
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

// One traced step of @p schedule on 4 thread-ranks, m = 8: each stage's compute spans.
std::vector<std::vector<TracedSpan>> traced_step(ScheduleKind schedule) {
  GptConfig model;
  model.layers = 4;
  model.hidden = 32;
  model.heads = 2;
  model.ctx = 16;
  model.tied = false;
  std::vector<std::vector<TracedSpan>> spans(kStages);
  run_ranks(
      kStages,
      [&](RankContext& ctx) {
        Gpt full(model);
        init_weights(full, 1);
        Stage stage = make_stage(full, kStages, ctx.rank);
        const Batch batch = ByteDataset::builtin().batch(1, 0, 16, model.ctx);
        const auto ops = make_schedule(schedule, kStages, kMicro, ctx.rank);
        auto tracer = std::make_shared<Tracer>(ctx.rank);
        tracer->set_clock(sync_clock(*ctx.store, ctx.rank, ctx.world));
        auto comm = c10::make_intrusive<TracingComm>(ctx.comm, tracer, "pipeline");
        {
          TraceScope scope(tracer.get());
          stage.begin_step();
          run_schedule(stage, *comm, ops, batch, kMicro);
        }
        spans[static_cast<size_t>(ctx.rank)] =
            select_spans(traced_spans(tracer->to_json()), ctx.rank, TraceTrack::kCompute);
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

}  // namespace
}  // namespace dtc::l09
