// Lesson 12's checkpoint of lesson 11's training: a run saved, dropped and resumed on the same
// mesh ends bit for bit where the run that never stopped ends; resumed on another mesh, where the
// single device's run ends, each rank having read only the saved pieces that overlap its own.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "adamw_params.h"
#include "checkpoint.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "memory_fs.h"
#include "nd.h"
#include "plain_baseline.h"
#include "state.h"

namespace dtc::l12 {
namespace {

using l11::NdGroups;
using l11::NdOptions;
using test::MemoryFs;

NdOptions options_of(const std::string& mix, bool tied = true) {
  NdOptions o;
  o.model.layers = 4;
  o.model.hidden = 32;
  o.model.heads = 2;
  o.model.ctx = 16;
  o.model.tied = tied;
  o.batch = 8;
  o.seed = 5;
  o.mix = parse_mix(mix, "--mix");
  o.schedule =
      o.mix.virtual_stages > 1 ? l09::ScheduleKind::kInterleaved : l09::ScheduleKind::k1f1b;
  return o;
}

// Runs @p body on every rank of @p o's mesh with its groups and the world's communicator.
void on_mesh(const NdOptions& o, const std::function<void(const NdGroups&, Comm&)>& body) {
  const int world = static_cast<int>(o.mix.world());
  l11::check_nd(o, world);
  run_ranks(
      world,
      [&](RankContext& ctx) {
        MemoryFs::thread_rank() = ctx.rank;
        const Mesh mesh = l11::make_mesh(o.mix, world);
        const NdGroups groups =
            l11::make_groups(ctx.store, mesh, ctx.rank, o.mix.zero_stage, BackendKind::kGloo,
                             std::chrono::milliseconds(10000));
        body(groups, *ctx.comm);
      },
      std::chrono::milliseconds(60000));
}

// What one rank ends with: its weights by name (tp slices as held) and its losses.
struct RankEnd {
  std::vector<std::pair<std::string, torch::Tensor>> weights;
  std::vector<float> losses;
};

// Steps [first, last) of @p trainer.
void train(l11::NdTrainer& trainer, int64_t first, int64_t last, std::vector<float>& losses) {
  for (int64_t s = first; s < last; ++s) losses.push_back(trainer.step(s).loss);
}

struct ResumeCase {
  const char* name;
  const char* mix;
  bool tied = true;
};

std::ostream& operator<<(std::ostream& os, const ResumeCase& c) { return os << c.name; }

class L12Resume : public ::testing::TestWithParam<ResumeCase> {};

// Four steps, against two steps, a save, a new trainer (a restarted job's: the initial weights,
// AdamW without state), the load and two more steps: every rank's weights equal, bit for bit, and
// so do the losses of steps 2 and 3. AdamW's moments and step count are in the weights of steps 2
// and 3: a moment not restored, or a step count left at 0, changes them.
TEST_P(L12Resume, AResumedRunEndsBitForBitWhereTheUninterruptedOneEnds) {
  const NdOptions o = options_of(GetParam().mix, GetParam().tied);
  std::mutex mu;
  std::map<int, RankEnd> straight, resumed;
  on_mesh(o, [&](const NdGroups& g, Comm&) {
    l11::NdTrainer trainer(o, g);
    RankEnd end;
    train(trainer, 0, 4, end.losses);
    end.weights = trainer.finish().weights;
    std::lock_guard<std::mutex> lock(mu);
    straight[g.rank] = end;
  });
  MemoryFs fs("ckpt");
  on_mesh(o, [&](const NdGroups& g, Comm& world) {
    RankEnd end;
    {
      l11::NdTrainer first(o, g);
      train(first, 0, 2, end.losses);
      save_checkpoint(fs, "ckpt", 2, rank_state(first, g, o), world, {{"step", 2}});
    }
    l11::NdTrainer again(o, g);  // the restart: initial weights, no optimizer state
    std::vector<StatePiece> pieces = rank_state(again, g, o);
    load_checkpoint(fs, step_dir("ckpt", 2), pieces);
    state_loaded(again, 2);
    train(again, 2, 4, end.losses);
    end.weights = again.finish().weights;
    std::lock_guard<std::mutex> lock(mu);
    resumed[g.rank] = end;
  });
  fs.crash();  // what was saved was durable
  EXPECT_EQ(latest_checkpoint(fs, "ckpt"), std::optional<int64_t>(2));
  ASSERT_EQ(straight.size(), resumed.size());
  for (const auto& [rank, want] : straight) {
    const RankEnd& got = resumed.at(rank);
    ASSERT_EQ(got.weights.size(), want.weights.size());
    for (size_t i = 0; i < want.weights.size(); ++i) {
      SCOPED_TRACE(fmt::format("rank {}: {}", rank, want.weights[i].first));
      EXPECT_EQ(got.weights[i].first, want.weights[i].first);
      EXPECT_TRUE(torch::equal(got.weights[i].second, want.weights[i].second))
          << "largest difference "
          << (got.weights[i].second - want.weights[i].second).abs().max().item<float>();
    }
    EXPECT_EQ(got.losses, want.losses) << "rank " << rank;
  }
}

INSTANTIATE_TEST_SUITE_P(Meshes, L12Resume,
                         ::testing::Values(ResumeCase{"dp2", "2x1x1x1"},
                                           ResumeCase{"tp2_pp2", "1x2x2x1"},
                                           ResumeCase{"pp2_untied", "1x1x2x1", false},
                                           ResumeCase{"interleaved_pp2_v2", "1x1x2x1:0:none:1:2"},
                                           ResumeCase{"zero1_dp2_tp2", "2x2x1x1:1"},
                                           ResumeCase{"zero3_dp4", "4x1x1x1:3"},
                                           ResumeCase{"cp2_dp2", "2x1x1x2"}),
                         [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// Another mesh
// ---------------------------------------------------------------------------------------------

struct ReshardCase {
  const char* name;
  const char* from;
  const char* to;
  bool fewer = true;  ///< some rank of `to` needs fewer than all saved pieces
};

std::ostream& operator<<(std::ostream& os, const ReshardCase& c) { return os << c.name; }

class L12Reshard : public ::testing::TestWithParam<ReshardCase> {};

// The elements two boxes share, written out here (not the learner's intersect()).
int64_t shared_elements(const Box& a, const Box& b) {
  int64_t n = 1;
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]);
    n *= std::max<int64_t>(0, hi - lo);
  }
  return n;
}

// Two steps on one mesh, saved; loaded on another, two more steps: the single device's parameters
// after four (resharding: every element from where the first mesh put it, moments included). And
// each rank of the second mesh read the metadata and, once each, the saved pieces that overlap its
// own pieces, nothing else: never the whole checkpoint on every rank.
TEST_P(L12Reshard, ALoadOnAnotherMeshContinuesTheSingleDevicesRun) {
  const NdOptions a = options_of(GetParam().from);
  const NdOptions b = options_of(GetParam().to);
  MemoryFs fs("ckpt");
  on_mesh(a, [&](const NdGroups& g, Comm& world) {
    l11::NdTrainer trainer(a, g);
    std::vector<float> losses;
    train(trainer, 0, 2, losses);
    save_checkpoint(fs, "ckpt", 2, rank_state(trainer, g, a), world, {{"step", 2}});
  });
  const std::string dir = step_dir("ckpt", 2);
  const int64_t metadata_bytes = fs.size(dir + "/metadata.json");
  const Metadata saved = metadata_from_json(fs.contents(dir + "/metadata.json"), "metadata");
  int64_t checkpoint_bytes = 0;
  for (const ShardFile& f : saved.files) checkpoint_bytes += f.bytes;
  const test::BaselineRun want = test::plain_baseline(b, 4);
  std::map<std::string, torch::Tensor> want_of;
  for (size_t i = 0; i < want.names.size(); ++i) want_of[want.names[i]] = want.params[i];
  fs.clear_reads();
  std::mutex mu;
  std::map<int, int64_t> allowed;
  on_mesh(b, [&](const NdGroups& g, Comm&) {
    l11::NdTrainer trainer(b, g);
    std::vector<StatePiece> pieces = rank_state(trainer, g, b);
    load_checkpoint(fs, dir, pieces);
    state_loaded(trainer, 2);
    // The saved pieces that overlap one of this rank's, each counted once.
    int64_t overlapping = 0;
    for (const ShardFile& f : saved.files) {
      for (const SavedPiece& s : f.pieces) {
        for (const StatePiece& p : pieces) {
          if (p.key == s.key && shared_elements(p.box, s.box) > 0) {
            overlapping += s.bytes;
            break;
          }
        }
      }
    }
    std::vector<float> losses;
    train(trainer, 2, 4, losses);
    const int tp_rank = g.tp->getRank(), tp = g.tp->getSize();
    for (const auto& [name, value] : trainer.finish().weights) {
      SCOPED_TRACE(fmt::format("rank {} of {}: {}", g.rank, g.mesh.describe(), name));
      torch::Tensor expected = want_of.at(name);
      if (tp > 1 && l11::tp_sharded(name)) {  // lesson 08's slice of it
        if (name.find("c_fc.") != std::string::npos) {
          expected = expected.chunk(tp, 0)[tp_rank];
        } else if (name.find("c_proj.weight") != std::string::npos) {
          expected = expected.chunk(tp, 1)[tp_rank];
        } else {
          const auto qkv = expected.chunk(3, 0);
          expected = torch::cat({qkv[0].chunk(tp, 0)[tp_rank], qkv[1].chunk(tp, 0)[tp_rank],
                                 qkv[2].chunk(tp, 0)[tp_rank]});
        }
      }
      EXPECT_ADAMW_PARAMS_CLOSE(value, expected, 4, b.lr);
    }
    std::lock_guard<std::mutex> lock(mu);
    allowed[g.rank] = overlapping;
  });
  for (const auto& [rank, bytes] : allowed) {
    SCOPED_TRACE(fmt::format("rank {} of {}", rank, GetParam().to));
    EXPECT_EQ(fs.bytes_read(rank), metadata_bytes + bytes)
        << "read other bytes than the metadata and each overlapping saved piece once";
  }
  // Where the second mesh splits what the first saved in pieces, some rank reads less than the
  // whole checkpoint (a piece saved whole is read whole by every rank that needs part of it).
  int64_t least = checkpoint_bytes;
  for (const auto& [rank, bytes] : allowed) least = std::min(least, bytes);
  if (GetParam().fewer) EXPECT_LT(least, checkpoint_bytes);
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, L12Reshard,
    ::testing::Values(ReshardCase{"dp2_to_tp2_pp2", "2x1x1x1", "1x2x2x1"},
                      ReshardCase{"tp2_pp2_to_zero1_dp2", "1x2x2x1", "2x1x1x1:1"},
                      ReshardCase{"zero3_dp4_to_one", "4x1x1x1:3", "1x1x1x1", false},
                      ReshardCase{"interleaved_to_tp2", "1x1x2x1:0:none:1:2", "1x2x1x1", false},
                      ReshardCase{"zero2_tp2_to_pp2_tp2", "2x2x1x1:2", "1x2x2x1"}),
    [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace dtc::l12
