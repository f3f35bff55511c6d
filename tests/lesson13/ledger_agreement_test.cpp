// Lesson 01's ledger against lesson 13: the MoE GPT's parameters, total and active, are what the
// ledger counts for the same shape, and the parameter bytes each rank holds under expert
// parallelism, measured by the counting allocator, are the ledger's E/ep of the routed experts
// plus everything else whole. Built where lesson 01's library is (the primary path); the
// reference solutions of both lessons.
#include <gtest/gtest.h>

#include <mutex>
#include <vector>

#include "dtc/memory.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "ledger.h"  // lesson 01
#include "moe.h"     // lesson 13

namespace dtc {
namespace {

/// The course's GPT (dtc::GptConfig's defaults) with an MoE layer of @p experts, as lesson 01
/// describes a model.
l01::ModelConfig ledger_model(int64_t experts, int64_t top_k) {
  l01::ModelConfig m = l01::preset("course-gpt");
  m.experts = experts;
  m.top_k = top_k;
  return m;
}

TEST(L13LedgerAgreement, TotalAndActiveParameters) {
  for (const auto& [e, k] : std::vector<std::pair<int64_t, int64_t>>{{4, 2}, {8, 2}, {8, 1}}) {
    l13::MoeConfig moe;
    moe.experts = e;
    moe.top_k = k;
    const GptConfig g;  // the course's GPT: h 128, 4 layers, vocab 256, ctx 64, tied
    Gpt model = l13::make_moe_gpt(g, moe, 1);
    const l01::ModelConfig m = ledger_model(e, k);
    EXPECT_EQ(count_parameters(*model), l01::count_params(m))
        << e << " experts: lesson 13's model against lesson 01's count";
    // active: every parameter but the E - k routed experts a token does not go through
    int64_t one_expert = 0;
    for (const auto& p : model->named_parameters()) {
      if (p.key().rfind("h.0.mlp.experts.", 0) == 0) one_expert += p.value().numel() / e;
    }
    EXPECT_EQ(count_parameters(*model) - g.layers * (e - k) * one_expert, l01::active_params(m))
        << e << " experts, top-" << k;
  }
}

// Each rank's parameter bytes after the model is built and sharded (the counting allocator, per
// thread-rank), against the ledger's params_per_replica in fp32 (4 bytes each): the E/ep routed
// experts of each layer it holds, and the rest whole. The only other tensors a rank keeps are the
// expert-bias buffers, E floats per layer.
TEST(L13LedgerAgreement, ExpertMemoryPerRankIsTheLedgers) {
  install_counting_allocator();
  const int64_t e = 8;
  for (int ep : {1, 2, 4}) {
    l13::MoeConfig moe;
    moe.experts = e;
    moe.top_k = 2;
    RunConfig run;  // the course's GPT
    run.batch = 4;
    std::mutex mu;
    std::vector<int64_t> measured(static_cast<size_t>(ep), 0);
    run_ranks(ep, [&](RankContext& ctx) {
      l13::MoeGroups g =
          l13::make_moe_groups(ctx.store, ctx.rank, ep, ep, BackendKind::kGloo, test::kTimeout);
      const int64_t before = thread_cpu_memory().current;
      l13::MoeTrainer trainer(run, moe, g);
      const int64_t held = thread_cpu_memory().current - before;
      std::lock_guard<std::mutex> lock(mu);
      measured[static_cast<size_t>(ctx.rank)] = held;
    });
    l01::TrainingSetup setup;
    setup.precision = l01::Precision::kFp32;
    setup.dp = ep;
    setup.ep = ep;
    const l01::ModelConfig m = ledger_model(e, 2);
    const l01::Ledger ledger = l01::compute_ledger(l01::count_params(m), setup, &m);
    const double buffers = 4.0 * e * run.model.layers;
    for (int r = 0; r < ep; ++r) {
      EXPECT_CLOSE_REL(static_cast<double>(measured[static_cast<size_t>(r)]),
                       ledger.state.params + buffers, 1e-9,
                       "lesson 01's ledger, fp32 parameters under --ep, + the expert biases");
    }
  }
}

}  // namespace
}  // namespace dtc
