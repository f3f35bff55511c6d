// Composition: lesson 08's tensor-parallel attention and MLP inside lesson 09's pipeline stages.
//
// A Gpt whose blocks were swapped for TpAttention and TpMlp (BlockImpl::swap_attention /
// swap_mlp: the names stay h.{i}.attn.*, h.{i}.mlp.*) is cut into stages by make_stage, which
// shares the blocks as they are; run_schedule then runs each stage's blocks with their TP
// collectives inside. On a pp 2 x tp 2 mesh (4 thread-ranks, pp slowest), one step of each
// schedule must give every rank the single-process gradients of the same batch: the replicated
// parameters (embeddings, LayerNorms, row-parallel biases, the head) whole, the sharded ones as
// their slices; every parameter of a rank's chunks has one and no other. The reference is one
// process's backward of the whole batch (the mean loss), within kFp32Steps: one backward, but
// summed over 4 micro-batches and split matmuls, so reordered sums.
// Lesson 11 builds its N-D run on this; the test keeps lessons 08 and 09 composable meanwhile.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <set>
#include <string>

#include "dtc/compare.h"
#include "dtc/data.h"
#include "dtc/mesh.h"
#include "dtc/model.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "pipeline.h"
#include "tensor_parallel.h"

namespace dtc {
namespace {

struct Case {
  l09::ScheduleKind schedule;
  int chunks;
};

class PpTimesTp : public ::testing::TestWithParam<Case> {};

// Rank @p r's slice of the full gradient @p full of parameter @p name (tp = 2), as lesson 08
// shards it: c_fc's rows, the c_proj weights' columns, and c_attn's rows of each of q, k and v.
// Undefined for a parameter every TP rank holds whole.
torch::Tensor tp_slice(const std::string& name, const torch::Tensor& full, int r, int64_t hidden) {
  if (name.find("mlp.c_fc.") != std::string::npos) return l08::shard(full, 0, r, 2);
  if (name.find("c_proj.weight") != std::string::npos) return l08::shard(full, 1, r, 2);
  if (name.find("attn.c_attn.") != std::string::npos) {
    const int64_t part = hidden / 2;
    return torch::cat({full.narrow(0, r * part, part), full.narrow(0, hidden + r * part, part),
                       full.narrow(0, 2 * hidden + r * part, part)});
  }
  return torch::Tensor();
}

TEST_P(PpTimesTp, OneStepGivesTheSingleProcessGradients) {
  const Case c = GetParam();
  GptConfig config;
  config.layers = 4;
  config.hidden = 32;
  config.heads = 2;
  config.ctx = 16;
  config.tied = false;  // the pipeline's head is untied (lesson 09)
  const int64_t rows = 8, micro_batches = 4;
  const uint64_t seed = 1;
  const Batch batch = ByteDataset::builtin().batch(seed, 0, rows, config.ctx);

  Gpt one(config);
  init_weights(one, seed);
  const torch::Tensor logits = one->forward(batch.inputs);
  torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}), batch.targets.view(-1))
      .backward();
  std::map<std::string, torch::Tensor> want;
  for (const auto& item : one->named_parameters()) want[item.key()] = item.value().grad();

  std::mutex mu;
  std::map<int, int> whole, sliced;  // per rank
  run_ranks(
      4,
      [&](RankContext& ctx) {
        const Mesh mesh = Mesh::build(4, {{"pp", 2, "--pp"}, {"tp", 2, "--tp"}});
        MeshGroups groups(ctx.store, mesh, ctx.rank, {{"pp"}, {"tp"}}, BackendKind::kGloo,
                          std::chrono::milliseconds(5000));
        Comm& pp = *groups.get({"pp"});
        Comm& tp = *groups.get({"tp"});
        Gpt model(config);
        init_weights(model, seed);
        for (size_t i = 0; i < model->h->size(); ++i) {
          auto& block = *model->h->ptr<BlockImpl>(i);
          block.swap_attention(l08::TpAttention(block.attn, config.heads, tp));
          block.swap_mlp(l08::TpMlp(block.mlp, tp));
        }
        std::vector<l09::Stage> chunks = l09::make_chunks(model, 2, c.chunks, pp.getRank());
        const auto ops = l09::make_schedule(c.schedule, 2, micro_batches, pp.getRank(), c.chunks);
        l09::run_schedule(chunks, pp, ops, batch, micro_batches);
        // Every parameter of this rank's chunks has its gradient (the embedding on the first
        // stage, the head on the last ones included), and no other parameter has one.
        std::set<const void*> mine;
        for (const auto& p : l09::parameters_of(chunks)) {
          EXPECT_TRUE(p.grad().defined()) << "rank " << ctx.rank << ": a parameter of its "
                                          << "chunks has no gradient";
          mine.insert(p.unsafeGetTensorImpl());
        }
        for (const auto& item : model->named_parameters()) {
          EXPECT_EQ(item.value().grad().defined(),
                    mine.count(item.value().unsafeGetTensorImpl()) > 0)
              << "rank " << ctx.rank << ": " << item.key();
        }
        for (const auto& item : model->named_parameters()) {
          const std::string& name = item.key();
          const torch::Tensor got = item.value().grad();
          if (!got.defined()) continue;  // another stage's
          SCOPED_TRACE(fmt::format("rank {} (pp {}, tp {}): {}", ctx.rank, pp.getRank(),
                                   tp.getRank(), name));
          const torch::Tensor slice = tp_slice(name, want.at(name), tp.getRank(), config.hidden);
          const torch::Tensor& expected = slice.defined() ? slice : want.at(name);
          EXPECT_TENSOR_CLOSE(got, expected, kFp32Steps);
          std::lock_guard<std::mutex> lock(mu);
          ++(slice.defined() ? sliced : whole)[ctx.rank];
        }
      },
      std::chrono::milliseconds(30000));
  // Every rank has gradients of both kinds: 2 blocks' LayerNorms and biases, and their shards.
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_GT(whole[rank], 0) << "rank " << rank << " compared no replicated gradient";
    EXPECT_EQ(sliced[rank], 2 * 6) << "rank " << rank << ": 2 blocks x 6 sharded tensors";
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, PpTimesTp,
                         ::testing::Values(Case{l09::ScheduleKind::k1f1b, 1},
                                           Case{l09::ScheduleKind::kInterleaved, 2},
                                           Case{l09::ScheduleKind::kZbH1, 1}),
                         [](const auto& info) {
                           return std::string(l09::schedule_name(info.param.schedule)) == "zb-h1"
                                      ? std::string("zb_h1")
                                      : std::string(l09::schedule_name(info.param.schedule));
                         });

}  // namespace
}  // namespace dtc
