// Lesson 09 tests: the stage split and the two schedules, as pure functions, against the
// textbook. Expected orders are written out by hand from the papers' figures:
//   GPipe: Huang et al. 2019, "GPipe", Figure 2(c); backward order as Narayanan et al. 2021,
//          "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
//          Figure 3 (and PyTorch's torch.distributed.pipelining.ScheduleGPipe).
//   1F1B:  Narayanan et al. 2021, Figure 4 (top): 4 devices, 8 micro-batches, PipeDream-Flush.
// Interleaved 1F1B and ZB-H1 against PyTorch's own schedules (ScheduleInterleaved1F1B and, with
// one chunk per rank, ScheduleInterleavedZeroBubble): the orders they compute, recorded by
// tests/reference/lesson09_schedules.py.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "dtc/data.h"
#include "dtc/errors.h"
#include "dtc_test.h"
#include "pipeline.h"

namespace dtc::l09 {
namespace {

TEST(L09Schedule, GpipeIsAllForwardsThenAllBackwards) {
  for (int s = 0; s < 4; ++s) {
    EXPECT_EQ(to_string(gpipe_schedule(4, 4, s)), "F0 F1 F2 F3 B0 B1 B2 B3") << "stage " << s;
  }
  EXPECT_EQ(to_string(gpipe_schedule(2, 1, 1)), "F0 B0");
}

// Narayanan et al. 2021, Figure 4 (top), devices 1-4 = stages 0-3, micro-batches 1-8 = 0-7.
TEST(L09Schedule, OneFOneBMatchesNarayananFigure4) {
  EXPECT_EQ(to_string(one_f_one_b_schedule(4, 8, 0)),
            "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  EXPECT_EQ(to_string(one_f_one_b_schedule(4, 8, 1)),
            "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7");
  EXPECT_EQ(to_string(one_f_one_b_schedule(4, 8, 2)),
            "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7");
  EXPECT_EQ(to_string(one_f_one_b_schedule(4, 8, 3)),
            "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
}

// Fewer micro-batches than stages: the warm-up is cut at m (Megatron's min(p - s - 1, m)).
TEST(L09Schedule, OneFOneBWithFewMicroBatches) {
  EXPECT_EQ(to_string(one_f_one_b_schedule(4, 2, 0)), "F0 F1 B0 B1");
  EXPECT_EQ(to_string(one_f_one_b_schedule(4, 2, 2)), "F0 F1 B0 B1");  // w = min(1, 2) = 1
  EXPECT_EQ(to_string(one_f_one_b_schedule(4, 2, 3)), "F0 B0 F1 B1");  // the last: w = 0
  EXPECT_EQ(to_string(one_f_one_b_schedule(2, 1, 0)), "F0 B0");
}

// Stored activations at the peak (closed form): GPipe m on every stage, 1F1B min(m, p - s).
TEST(L09Schedule, MicroBatchesInFlight) {
  for (int s = 0; s < 4; ++s) {
    EXPECT_EQ(max_in_flight(gpipe_schedule(4, 8, s)), 8) << "stage " << s;
    EXPECT_EQ(max_in_flight(one_f_one_b_schedule(4, 8, s)), 4 - s) << "stage " << s;
  }
}

// tests/reference/lesson09_schedules.json: PyTorch's orders, one case per (schedule, p, v, m).
const nlohmann::json& pytorch_orders() {
  static const nlohmann::json j = [] {
    std::ifstream in(source_path("tests/reference/lesson09_schedules.json"));
    return nlohmann::json::parse(in);
  }();
  return j;
}

// Every rank of every recorded case of @p schedule against PyTorch's order.
void expect_pytorch_orders(const std::string& schedule) {
  int cases = 0;
  for (const auto& c : pytorch_orders().at("cases")) {
    if (c.at("schedule") != schedule) continue;
    ++cases;
    const int p = c.at("stages"), v = c.at("chunks");
    const int64_t m = c.at("micro_batches");
    for (int r = 0; r < p; ++r) {
      SCOPED_TRACE(testing::Message()
                   << schedule << ": p " << p << ", v " << v << ", m " << m << ", rank " << r);
      const std::vector<Op> ops =
          schedule == "zb-h1" ? zb_h1_schedule(p, m, r) : interleaved_schedule(p, m, r, v);
      EXPECT_EQ(to_string(ops), c.at("ranks").at(static_cast<size_t>(r)).get<std::string>());
    }
  }
  EXPECT_GE(cases, 5) << "the reference file lost its " << schedule << " cases";
}

// Megatron-LM's docstring example and the schedules.py order for p = 2, v = 2, m = 4 (chunk
// first, then the micro-batch): rank 0 warms up with all four forwards of the first group.
TEST(L09Interleaved, MatchesMegatronsOrderForTwoRanksTwoChunks) {
  EXPECT_EQ(to_string(interleaved_schedule(2, 4, 0, 2)),
            "0F0 0F1 1F0 1F1 0F2 1B0 0F3 1B1 1F2 0B0 1F3 0B1 1B2 1B3 0B2 0B3");
  EXPECT_EQ(to_string(interleaved_schedule(2, 4, 1, 2)),
            "0F0 0F1 1F0 1B0 1F1 1B1 0F2 0B0 0F3 0B1 1F2 1B2 1F3 1B3 0B2 0B3");
}

TEST(L09Interleaved, MatchesPyTorchsScheduleInterleaved1F1B) {
  expect_pytorch_orders("interleaved");
}

// The warm-up, counted: forwards before the first backward, 2 (p - r - 1) + (v - 1) p, all of
// them (v m) when that is more; and a rank holds exactly its warm-up plus one at its peak.
TEST(L09Interleaved, WarmUpIsTheRoundTripPlusTheEarlierChunks) {
  for (int p : {2, 3, 4}) {
    for (int v : {2, 3}) {
      for (int64_t m : {int64_t{p}, int64_t{2} * p, int64_t{3} * p}) {
        for (int r = 0; r < p; ++r) {
          SCOPED_TRACE(testing::Message()
                       << "p " << p << ", v " << v << ", m " << m << ", rank " << r);
          const auto ops = interleaved_schedule(p, m, r, v);
          ASSERT_EQ(ops.size(), static_cast<size_t>(2 * v * m));
          // The warm-up's forwards, then the steady state's first forward: all before a backward.
          int64_t leading = 0;
          while (ops[static_cast<size_t>(leading)].kind == Op::kForward) ++leading;
          const int64_t want = std::min<int64_t>(2 * (p - r - 1) + (v - 1) * p, v * m);
          EXPECT_EQ(leading, std::min<int64_t>(want + 1, v * m));
          EXPECT_EQ(max_in_flight(ops), std::min<int64_t>(want + 1, v * m));
        }
      }
    }
  }
}

// The paper's ZB-H1 for 4 stages and 8 micro-batches (Qi et al. 2024, Figure 3, top): W of
// micro-batch j right after the I of j + stage, the W's left at the end.
TEST(L09ZeroBubble, MatchesTheZeroBubblePapersFigure) {
  EXPECT_EQ(to_string(zb_h1_schedule(4, 8, 0)),
            "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7");
  EXPECT_EQ(to_string(zb_h1_schedule(4, 8, 1)),
            "F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7");
  EXPECT_EQ(to_string(zb_h1_schedule(4, 8, 3)),
            "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7");
}

TEST(L09ZeroBubble, MatchesPyTorchsZeroBubbleWithOneChunk) { expect_pytorch_orders("zb-h1"); }

// Every stage holds at most p graphs (1F1B's first stage's count), fewer micro-batches than
// stages included, and every micro-batch gets one F, one I and one W, the W after the I.
TEST(L09ZeroBubble, EveryStageHoldsWhatOneFOneBsFirstStageHolds) {
  for (int p : {2, 3, 4}) {
    for (int64_t m : {1, 2, 3, 4, 8}) {
      for (int s = 0; s < p; ++s) {
        SCOPED_TRACE(testing::Message() << "p " << p << ", m " << m << ", stage " << s);
        const auto ops = zb_h1_schedule(p, m, s);
        EXPECT_EQ(max_in_flight(ops), std::min<int64_t>(m, p));
        std::vector<int> seen(static_cast<size_t>(m), 0);  // bit 0: F, 1: I, 2: W
        for (const auto& op : ops) {
          ASSERT_GE(op.micro, 0);
          ASSERT_LT(op.micro, m);
          int& bits = seen[static_cast<size_t>(op.micro)];
          const int bit = op.kind == Op::kForward ? 1 : op.kind == Op::kInput ? 2 : 4;
          ASSERT_NE(op.kind, Op::kBackward);
          EXPECT_EQ(bits & bit, 0) << "micro-batch " << op.micro << " twice";
          EXPECT_EQ(bits, bit - 1) << "micro-batch " << op.micro << ": F, then I, then W";
          bits |= bit;
        }
        for (int bits : seen) EXPECT_EQ(bits, 7);
      }
    }
  }
}

// The documented rule: layers / stages each, the first layers % stages one more.
TEST(L09Split, LayersAsEvenAsPossible) {
  auto blocks = [](int64_t layers, int stages) {
    std::string text;
    for (int s = 0; s < stages; ++s) {
      const StageLayers l = stage_layers(layers, stages, s);
      text += "[" + std::to_string(l.first) + "," + std::to_string(l.last) + ")";
    }
    return text;
  };
  EXPECT_EQ(blocks(4, 2), "[0,2)[2,4)");
  EXPECT_EQ(blocks(5, 2), "[0,3)[3,5)");
  EXPECT_EQ(blocks(6, 4), "[0,2)[2,4)[4,5)[5,6)");
  EXPECT_EQ(blocks(4, 4), "[0,1)[1,2)[2,3)[3,4)");
  EXPECT_EQ(blocks(3, 1), "[0,3)");
  EXPECT_TRUE(stage_layers(4, 2, 0).embed);
  EXPECT_FALSE(stage_layers(4, 2, 0).head);
  EXPECT_TRUE(stage_layers(4, 2, 1).head);
  EXPECT_FALSE(stage_layers(4, 2, 1).embed);
  EXPECT_TRUE(stage_layers(4, 1, 0).embed && stage_layers(4, 1, 0).head);
}

// Given code: the checks, the schedule names, the in-flight count.
TEST(L09ChecksGiven, StagesMustNotExceedLayers) {
  GptConfig c;
  c.layers = 2;
  try {
    check_pipeline(c, 3, 8, 1);
    FAIL() << "3 stages for 2 layers was accepted";
  } catch (const UsageError& e) {
    EXPECT_EQ(e.subject(), "--stages");
    EXPECT_NE(std::string(e.what()).find("more stages than layers"), std::string::npos);
  }
  EXPECT_NO_THROW(check_pipeline(c, 2, 8, 1));
}

TEST(L09ChecksGiven, MicroBatchesMustDivideTheBatch) {
  GptConfig c;
  try {
    check_pipeline(c, 2, 8, 3);
    FAIL() << "3 micro-batches of a batch of 8 was accepted";
  } catch (const UsageError& e) {
    EXPECT_EQ(e.subject(), "--micro-batches");
    EXPECT_NE(std::string(e.what()).find("does not divide"), std::string::npos);
  }
  EXPECT_THROW(check_pipeline(c, 2, 8, 0), UsageError);
  EXPECT_NO_THROW(check_pipeline(c, 2, 8, 8));
}

TEST(L09ChecksGiven, TiedModelsAreRefused) {
  GptConfig c;
  c.tied = true;
  Gpt full(c);
  EXPECT_THROW(make_stage(full, 2, 0), UsageError);
}

TEST(L09ChecksGiven, InterleavedNeedsChunksLayersAndMicroBatchesThatFit) {
  GptConfig c;
  c.layers = 4;
  auto subject = [&](int stages, int chunks, int64_t m) {
    try {
      check_interleaved(c, stages, chunks, m);
      return std::string("accepted");
    } catch (const UsageError& e) {
      return e.subject();
    }
  };
  EXPECT_EQ(subject(2, 2, 4), "accepted");
  EXPECT_EQ(subject(2, 1, 4), "--virtual-stages");  // one chunk: that is 1F1B
  EXPECT_EQ(subject(2, 3, 4), "--virtual-stages");  // 4 layers do not split into 2 x 3
  EXPECT_EQ(subject(4, 2, 4), "--virtual-stages");  // 4 layers, 8 chunks
  EXPECT_EQ(subject(2, 2, 3), "--micro-batches");   // not a multiple of p
  EXPECT_EQ(subject(2, 2, 1), "--micro-batches");
  EXPECT_EQ(subject(2, 2, 6), "accepted");
}

TEST(L09ChecksGiven, ScheduleNamesAndInFlight) {
  EXPECT_EQ(parse_schedule("gpipe"), ScheduleKind::kGpipe);
  EXPECT_EQ(parse_schedule("1f1b"), ScheduleKind::k1f1b);
  EXPECT_EQ(parse_schedule("interleaved"), ScheduleKind::kInterleaved);
  EXPECT_EQ(parse_schedule("zb-h1"), ScheduleKind::kZbH1);
  for (auto kind : {ScheduleKind::kGpipe, ScheduleKind::k1f1b, ScheduleKind::kInterleaved,
                    ScheduleKind::kZbH1}) {
    EXPECT_EQ(parse_schedule(schedule_name(kind)), kind);
  }
  // I keeps the graph, W lets it go; chunks count together.
  EXPECT_EQ(max_in_flight({{Op::kForward, 0},
                           {Op::kInput, 0},
                           {Op::kForward, 1},
                           {Op::kWeight, 0},
                           {Op::kInput, 1},
                           {Op::kWeight, 1}}),
            2);
  EXPECT_EQ(to_string({{Op::kForward, 0, 0},
                       {Op::kForward, 0, 1},
                       {Op::kBackward, 0, 1},
                       {Op::kBackward, 0, 0}}),
            "0F0 1F0 1B0 0B0");
  EXPECT_EQ(to_string({{Op::kForward, 0}, {Op::kInput, 0}, {Op::kWeight, 0}}), "F0 I0 W0");
  EXPECT_THROW(parse_schedule("zb-v"), UsageError);
  // F0 F1 B0 F2 B1 B2: at most 2 stored
  const std::vector<Op> ops{{Op::kForward, 0}, {Op::kForward, 1},  {Op::kBackward, 0},
                            {Op::kForward, 2}, {Op::kBackward, 1}, {Op::kBackward, 2}};
  EXPECT_EQ(max_in_flight(ops), 2);
  EXPECT_EQ(to_string(ops), "F0 F1 B0 F2 B1 B2");
}

}  // namespace
}  // namespace dtc::l09
