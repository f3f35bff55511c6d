// Lesson 09 tests: the stage split and the two schedules, as pure functions, against the
// textbook. Expected orders are written out by hand from the papers' figures:
//   GPipe: Huang et al. 2019, "GPipe", Figure 2(c); backward order as Narayanan et al. 2021,
//          "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
//          Figure 3 (and PyTorch's torch.distributed.pipelining.ScheduleGPipe).
//   1F1B:  Narayanan et al. 2021, Figure 4 (top): 4 devices, 8 micro-batches, PipeDream-Flush.
#include <gtest/gtest.h>

#include <string>

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

TEST(L09ChecksGiven, ScheduleNamesAndInFlight) {
  EXPECT_EQ(parse_schedule("gpipe"), ScheduleKind::kGpipe);
  EXPECT_EQ(parse_schedule("1f1b"), ScheduleKind::k1f1b);
  EXPECT_THROW(parse_schedule("zb-v"), UsageError);
  // F0 F1 B0 F2 B1 B2: at most 2 stored
  const std::vector<Op> ops{{Op::kForward, 0}, {Op::kForward, 1},  {Op::kBackward, 0},
                            {Op::kForward, 2}, {Op::kBackward, 1}, {Op::kBackward, 2}};
  EXPECT_EQ(max_in_flight(ops), 2);
  EXPECT_EQ(to_string(ops), "F0 F1 B0 F2 B1 B2");
}

}  // namespace
}  // namespace dtc::l09
