// Lesson 01's planner against lesson 10: the context-parallel traffic the planner costs (its
// kCp, all-gather of K and V forward, reduce-scatter of their gradients backward: Llama 3's CP)
// is what lesson 10's all-gather attention puts on the wire, by the closed form the recorded
// bytes are checked against (L10AllGather.SendsTheClosedFormBytes). Built where lesson 01's
// library is (the primary path); the reference solutions of both lessons.
#include <gtest/gtest.h>

#include "dtc_test.h"
#include "program.h"   // lesson 10: attention_volume
#include "strategy.h"  // lesson 01: step_bytes_per_gpu

namespace dtc {
namespace {

TEST(L10PlannerAgreement, CpTrafficIsTheAllGatherAttentions) {
  // The course's GPT as lesson 01 describes a model: multi-head attention (kv_dim = h).
  l01::PlanRequest req;
  req.model.arch = l01::Arch::kGpt;
  req.model.hidden = 128;
  req.model.layers = 4;
  req.model.heads = 4;
  req.model.kv_heads = 4;
  req.model.ffn = 512;
  req.model.vocab = 256;
  req.model.ctx = 4096;
  req.setup.seq = 4096;
  for (int cp : {2, 4, 8}) {
    l01::Mix mix;
    mix.cp = cp;
    mix.dp = 1;
    mix.micro_batch = 2;
    req.gpus = cp;
    req.global_batch = 2;  // one micro-batch a step
    const double planner = l01::step_bytes_per_gpu(l01::Strategy::kCp, req, mix);
    const l10::AttentionVolume v =
        l10::attention_volume(l10::Attention::kAllGather, 2, 4096, 128, cp);
    const double lesson10 = 4 * (v.forward + v.backward) * 2.0;  // 4 layers, 16-bit as planned
    EXPECT_CLOSE_REL(planner, lesson10, 1e-12,
                     "lesson 10's all-gather attention, forward + backward, 4 layers, 2 bytes");
  }
}

}  // namespace
}  // namespace dtc
