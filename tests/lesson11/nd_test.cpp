// Lesson 11: the composed run against one device.
//
// Each mesh runs on thread-ranks (one process, a HashStore, gloo, as PyTorch's own c10d tests
// do) and is compared with a single-device run written out here in plain LibTorch: the course's
// GPT from the same initial weights (dtc::init_weights), the whole global batch, its mean
// cross-entropy, torch::nn::utils::clip_grad_norm_ when clipping, torch::optim::AdamW. Nothing
// of the learner's code computes a reference: a rank's gradients and parameters are read from
// its model's tensors, and each is compared with the single device's (a tp shard with its slice).
//
// The meshes: dp x tp x pp on 8 ranks, tied and untied; interleaved (pp 2 x v 2) x dp 2;
// tp x pp under ZB-H1; pp 3 (uneven stages) and pp 4, where 2 stages hide an index error; pp 1
// (both copies of the tied embedding on one rank); full recomputation with dp; dp x cp x tp
// (lesson 10's ring) and cp x tp x pp with the zig-zag split; ZeRO-1 over dp x cp on four of
// them, where each rank's gradients are its shard (zeros elsewhere) and its AdamW moments too.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "adamw_params.h"
#include "bf16_policy.h"
#include "digest_close.h"
#include "dtc/compare.h"
#include "dtc/data.h"
#include "dtc/digest.h"
#include "dtc/errors.h"
#include "dtc/memory.h"
#include "dtc/ranks.h"
#include "dtc_test.h"
#include "ledger.h"
#include "nd.h"
#include "plain_baseline.h"
#include "strategy.h"

namespace dtc {
namespace {

using l11::NdGroups;
using l11::NdOptions;
using l11::RankModel;

constexpr double kInf = std::numeric_limits<double>::infinity();

struct MeshCase {
  const char* name;
  const char* mix;
  l09::ScheduleKind schedule;
  bool tied;
  bool zigzag = false;
  l10::Attention attention = l10::Attention::kRing;
  bool sequence_parallel = false;
};

std::ostream& operator<<(std::ostream& os, const MeshCase& c) { return os << c.name; }

NdOptions options_of(const MeshCase& c) {
  NdOptions o;
  o.model.layers = 4;
  o.model.hidden = 32;
  o.model.heads = 2;
  o.model.ctx = 16;
  o.model.tied = c.tied;
  o.batch = 8;
  o.seed = 3;
  o.mix = parse_mix(c.mix, "--mix");
  o.schedule = c.schedule;
  o.zigzag = c.zigzag;
  o.attention = c.attention;
  o.sequence_parallel = c.sequence_parallel;
  return o;
}

// The single device: the gradients of batch 0's mean loss, clipped when @p clip > 0.
struct OneDevice {
  std::map<std::string, torch::Tensor> grads;  // by the full model's names
  double norm = 0;                             // clip_grad_norm_'s total norm (when clipping)
};

OneDevice one_device_step(const NdOptions& o, double clip, double norm_type) {
  Gpt model(o.model);
  init_weights(model, o.seed);
  const Batch b = ByteDataset::builtin().batch(o.seed, 0, o.batch, o.model.ctx);
  const auto logits = model->forward(b.inputs);
  torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                       b.targets.reshape({-1}))
      .backward();
  OneDevice out;
  if (clip > 0) out.norm = torch::nn::utils::clip_grad_norm_(model->parameters(), clip, norm_type);
  for (const auto& item : model->named_parameters()) {
    out.grads[item.key()] = item.value().grad().clone();
  }
  return out;
}

// The single device after @p steps steps of AdamW (with clip_grad_norm_ when @p clip > 0):
// the course's plain baseline, its parameters by name.
std::map<std::string, torch::Tensor> one_device_train(const NdOptions& o, int64_t steps,
                                                      double clip, double norm_type,
                                                      nlohmann::json* digest = nullptr,
                                                      std::vector<float>* losses = nullptr) {
  const ::dtc::test::BaselineRun run = ::dtc::test::plain_baseline(o, steps, clip, norm_type);
  if (digest != nullptr) *digest = run.digest;
  if (losses != nullptr) *losses = run.losses;
  std::map<std::string, torch::Tensor> params;
  for (size_t i = 0; i < run.names.size(); ++i) params[run.names[i]] = run.params[i];
  return params;
}

// What tp rank @p r of @p tp holds of the full tensor @p full called @p name: lesson 08's
// slices (c_fc's rows, both c_proj weights' columns, c_attn's rows of each of q, k and v), or
// the whole.
torch::Tensor tp_piece(const std::string& name, const torch::Tensor& full, int r, int tp) {
  if (tp == 1 || !l11::tp_sharded(name)) return full;
  if (name.find("mlp.c_fc.") != std::string::npos) return full.chunk(tp, 0)[r];
  if (name.find("c_proj.weight") != std::string::npos) return full.chunk(tp, 1)[r];
  // attn.c_attn: [q | k | v] along dim 0, each h rows
  const auto qkv = full.chunk(3, 0);
  return torch::cat({qkv[0].chunk(tp, 0)[r], qkv[1].chunk(tp, 0)[r], qkv[2].chunk(tp, 0)[r]});
}

// Whether lesson 08 splits the parameter called @p name over tp (c_attn, c_fc, both c_proj
// weights), written out here rather than read from the given tp_sharded().
bool split_over_tp(const std::string& name) {
  return name.find("c_attn.") != std::string::npos || name.find("c_fc.") != std::string::npos ||
         name.find("c_proj.weight") != std::string::npos;
}

// Runs @p body on every rank of @p o's mesh with its groups.
void on_mesh(const NdOptions& o, const std::function<void(const NdGroups&)>& body) {
  const int world = static_cast<int>(o.mix.world());
  l11::check_nd(o, world);
  run_ranks(
      world,
      [&](RankContext& ctx) {
        const Mesh mesh = l11::make_mesh(o.mix, world);
        const NdGroups groups =
            l11::make_groups(ctx.store, mesh, ctx.rank, o.mix.zero_stage, BackendKind::kGloo,
                             std::chrono::milliseconds(10000));
        body(groups);
      },
      std::chrono::milliseconds(60000));
}

// Under ZeRO, what rank r of the n = dp_shard x cp ranks (dp x cp; HSDP's N x cp) holds of
// @p piece after the reduce-scatter: its chunk r of the flattened elements (each cut into n equal
// chunks of ceil(numel / n)), zeros elsewhere. Written out here, not read from the given
// shard_range().
torch::Tensor zero1_shard(const torch::Tensor& piece, const Mesh& mesh, int rank) {
  const std::vector<std::string> dims{"dp_shard", "cp"};
  const int64_t n = mesh.size(dims), r = mesh.coord(rank, dims);
  const int64_t chunk = (piece.numel() + n - 1) / n;
  auto out = torch::zeros_like(piece);
  const int64_t begin = std::min(r * chunk, piece.numel());
  const int64_t size = std::min(chunk, piece.numel() - begin);
  out.view({-1}).narrow(0, begin, size).copy_(piece.reshape({-1}).narrow(0, begin, size));
  return out;
}

// Every gradient of every rank (the tied head's copy included: it must hold wte's) against the
// single device's (under ZeRO-1, the rank's shard of it).
void expect_gradients(const RankModel& model, const NdGroups& g, const OneDevice& want,
                      std::mutex& mu, std::map<int, int>& compared) {
  for (const auto& chunk : model.chunks) {
    for (const auto& [name, param] : l09::stage_pieces(chunk)) {
      const std::string full = model.tied && name == "lm_head.weight" ? "wte.weight" : name;
      SCOPED_TRACE(fmt::format("rank {} ({}): {}'s gradient", g.rank, g.mesh.describe(), name));
      ASSERT_TRUE(param.grad().defined());
      torch::Tensor expected = tp_piece(full, want.grads.at(full), model.tp_rank, model.tp);
      if (g.zero_stage > 0) expected = zero1_shard(expected, g.mesh, g.rank);
      EXPECT_TENSOR_CLOSE(param.grad(), expected, kFp32Steps);
      std::lock_guard<std::mutex> lock(mu);
      ++compared[g.rank];
    }
  }
}

class L11OneStep : public ::testing::TestWithParam<MeshCase> {};

// One step's gradients, after the reduction and the tied embedding's sync, on every rank: the
// single device's (the gradient of the global batch's mean loss), whole or as the rank's slice.
// AdamW would hide a gradient k times too large; this does not.
TEST_P(L11OneStep, GradientsAreTheSingleDevicesOnEveryRank) {
  const NdOptions o = options_of(GetParam());
  const OneDevice want = one_device_step(o, 0, 2);
  std::mutex mu;
  std::map<int, int> compared;
  on_mesh(o, [&](const NdGroups& g) {
    RankModel model = l11::build_rank_model(o, g);
    const l11::StepOut out = l11::nd_step(model, g, o, 0);
    (void)out;
    expect_gradients(model, g, want, mu, compared);
  });
  for (int r = 0; r < static_cast<int>(o.mix.world()); ++r) {
    EXPECT_GT(compared[r], 0) << "rank " << r << " compared no gradient";
  }
}

const MeshCase kMeshes[] = {
    {"dp2_tp2_pp2_tied", "2x2x2x1", l09::ScheduleKind::k1f1b, true},
    {"dp2_tp2_pp2_untied", "2x2x2x1", l09::ScheduleKind::k1f1b, false},
    {"pp2_v2_dp2_tied", "2x1x2x1:0:none:1:2", l09::ScheduleKind::kInterleaved, true},
    {"tp2_pp2_zbh1_tied", "1x2x2x1", l09::ScheduleKind::kZbH1, true},
    {"pp3_uneven_tied", "1x1x3x1", l09::ScheduleKind::k1f1b, true},
    {"pp4_tied", "1x1x4x1", l09::ScheduleKind::k1f1b, true},
    {"dp2_tp2_pp1_tied", "2x2x1x1", l09::ScheduleKind::k1f1b, true},
    {"dp2_pp2_full_recompute_untied", "2x1x2x1:0:full", l09::ScheduleKind::k1f1b, false},
    {"dp2_cp2_tp2_tied", "2x2x1x2", l09::ScheduleKind::k1f1b, true},
    {"cp2_tp2_pp2_zigzag_tied", "1x2x2x2", l09::ScheduleKind::k1f1b, true, true},
    {"dp2_pp2_cp2_ulysses_untied", "2x1x2x2", l09::ScheduleKind::k1f1b, false, false,
     l10::Attention::kUlysses},
    // for the traffic's closed forms: full recomputation under tp and cp, all-gather attention
    {"tp2_pp2_cp2_full_allgather_tied", "1x2x2x2:0:full", l09::ScheduleKind::k1f1b, true, false,
     l10::Attention::kAllGather},
    {"pp2_cp2_zbh1_ring_untied", "1x1x2x2", l09::ScheduleKind::kZbH1, false},
    // ZeRO-1 (Megatron's distributed optimizer) over dp x cp: 13-16
    {"dp2_tp2_pp2_zero1_tied", "2x2x2x1:1", l09::ScheduleKind::k1f1b, true},
    {"pp2_v2_dp2_zero1_untied", "2x1x2x1:1:none:1:2", l09::ScheduleKind::kInterleaved, false},
    {"cp2_tp2_pp2_zero1_zigzag_tied", "1x2x2x2:1", l09::ScheduleKind::k1f1b, true, true},
    {"dp4_pp1_zero1_tied", "4x1x1x1:1", l09::ScheduleKind::k1f1b, true},
    // ZeRO-2, ZeRO-3 (FSDP) and HSDP: 17-20
    {"dp2_tp2_pp2_zero2_tied", "2x2x2x1:2", l09::ScheduleKind::k1f1b, true},
    {"dp2_tp2_pp2_zero3_tied", "2x2x2x1:3", l09::ScheduleKind::k1f1b, true},
    {"hsdp2x2_tp2_tied", "4x2x1x1:hsdp2", l09::ScheduleKind::k1f1b, true},
    {"hsdp2x2_pp2_v2_untied", "4x1x2x1:hsdp2:none:1:2", l09::ScheduleKind::kInterleaved, false},
    // sequence parallelism over tp inside the stages: 21-24
    {"tp2_pp2_sp_tied", "1x2x2x1", l09::ScheduleKind::k1f1b, true, false, l10::Attention::kRing,
     true},
    {"dp2_tp2_pp2_zero1_sp_untied", "2x2x2x1:1", l09::ScheduleKind::k1f1b, false, false,
     l10::Attention::kRing, true},
    {"tp2_pp2_cp2_zigzag_sp_tied", "1x2x2x2", l09::ScheduleKind::k1f1b, true, true,
     l10::Attention::kRing, true},
    {"tp2_pp2_v2_full_sp_tied", "1x2x2x1:0:full:1:2", l09::ScheduleKind::kInterleaved, true, false,
     l10::Attention::kRing, true},
};

INSTANTIATE_TEST_SUITE_P(Meshes, L11OneStep, ::testing::ValuesIn(kMeshes),
                         [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// Clipping: the global norm, 2 and inf, counts every parameter once
// ---------------------------------------------------------------------------------------------

struct ClipCase {
  MeshCase mesh;
  double norm_type;
};

std::ostream& operator<<(std::ostream& os, const ClipCase& c) {
  return os << c.mesh.name << (std::isinf(c.norm_type) ? ", inf-norm" : ", 2-norm");
}

class L11Clip : public ::testing::TestWithParam<ClipCase> {};

// The norm clip_grad_norm returns is the single device's clip_grad_norm_ total (a replicated
// parameter counted twice, the tied copy counted, a dp replica's copy counted, or MAX summed: a
// different number), and the clipped gradients are the single device's clipped ones on every
// rank. The max norm is half the single device's norm, so clipping happens.
TEST_P(L11Clip, TheGlobalNormAndTheClippedGradientsAreTheSingleDevices) {
  const ClipCase c = GetParam();
  NdOptions o = options_of(c.mesh);
  // The single device's norm first (a huge max norm clips nothing), then half of it.
  const double norm = one_device_step(o, 1e9, c.norm_type).norm;
  ASSERT_GT(norm, 0);
  o.clip = norm / 2;
  o.norm_type = c.norm_type;
  const OneDevice want = one_device_step(o, o.clip, c.norm_type);
  std::mutex mu;
  std::map<int, int> compared;
  on_mesh(o, [&](const NdGroups& g) {
    RankModel model = l11::build_rank_model(o, g);
    const l11::StepOut out = l11::nd_step(model, g, o, 0);
    EXPECT_NEAR(out.grad_norm, want.norm, 1e-5 * want.norm)
        << "rank " << g.rank << ": the " << (std::isinf(c.norm_type) ? "inf" : "2")
        << "-norm of the whole model's gradient";
    expect_gradients(model, g, want, mu, compared);
  });
}

// A max norm above the norm changes nothing: the gradients stay the unclipped single device's,
// and the norm is still reported.
TEST(L11ClipAbove, AMaxNormAboveTheNormLeavesTheGradients) {
  NdOptions o = options_of(MeshCase{"dp2_tp2_pp2_tied", "2x2x2x1", l09::ScheduleKind::k1f1b, true});
  const OneDevice unclipped = one_device_step(o, 1e9, 2);
  o.clip = 2 * unclipped.norm;
  std::mutex mu;
  std::map<int, int> compared;
  on_mesh(o, [&](const NdGroups& g) {
    RankModel model = l11::build_rank_model(o, g);
    const l11::StepOut out = l11::nd_step(model, g, o, 0);
    EXPECT_NEAR(out.grad_norm, unclipped.norm, 1e-5 * unclipped.norm) << "rank " << g.rank;
    expect_gradients(model, g, unclipped, mu, compared);
  });
}

// The inf-norm is the largest magnitude, whatever its sign: every gradient of stage s set to
// -(s + 1) (closed form: the norm is pp, the last stage's), on tp 2 x pp 2.
TEST(L11ClipInf, TheInfNormIsTheLargestMagnitudeOfNegativeGradients) {
  const NdOptions o = options_of(MeshCase{"tp2_pp2", "1x2x2x1", l09::ScheduleKind::k1f1b, true});
  on_mesh(o, [&](const NdGroups& g) {
    RankModel model = l11::build_rank_model(o, g);
    const double value = -(1.0 + g.pp->getRank());
    for (auto p : l09::parameters_of(model.chunks)) p.mutable_grad() = torch::full_like(p, value);
    EXPECT_DOUBLE_EQ(l11::global_grad_norm(model, *g.norm, kInf), 2.0) << "rank " << g.rank;
  });
}

const ClipCase kClips[] = {
    {kMeshes[0], 2},     {kMeshes[0], kInf},  {kMeshes[2], 2},    {kMeshes[3], kInf},
    {kMeshes[4], 2},     {kMeshes[6], 2},     {kMeshes[6], kInf}, {kMeshes[8], 2},
    {kMeshes[9], kInf},  {kMeshes[1], kInf},  {kMeshes[10], 2},   {kMeshes[13], 2},
    {kMeshes[14], kInf}, {kMeshes[15], 2},    {kMeshes[16], 2},   {kMeshes[18], kInf},
    {kMeshes[19], 2},    {kMeshes[19], kInf}, {kMeshes[20], 2},   {kMeshes[21], 2},
    {kMeshes[23], kInf}, {kMeshes[17], 2},
};

INSTANTIATE_TEST_SUITE_P(Meshes, L11Clip, ::testing::ValuesIn(kClips), [](const auto& info) {
  return std::string(info.param.mesh.name) + (std::isinf(info.param.norm_type) ? "_inf" : "_l2");
});

// ---------------------------------------------------------------------------------------------
// Training: parameters after several steps
// ---------------------------------------------------------------------------------------------

class L11Train : public ::testing::TestWithParam<MeshCase> {};

// Three steps of AdamW with 2-norm clipping at half the first step's norm (so every step clips):
// every rank's parameters, the digest of the whole model and the losses nd_step reports (the
// global batch's mean, on every rank) are the single device's.
TEST_P(L11Train, ParametersAfterThreeClippedStepsAreTheSingleDevices) {
  NdOptions o = options_of(GetParam());
  o.steps = 3;
  o.clip = one_device_step(o, 1e9, 2).norm / 2;
  o.digest = true;
  nlohmann::json want_digest;
  std::vector<float> want_losses;
  const auto want = one_device_train(o, o.steps, o.clip, 2, &want_digest, &want_losses);
  on_mesh(o, [&](const NdGroups& g) {
    const l11::NdResult result = l11::train_nd(o, g);
    ASSERT_FALSE(result.weights.empty());
    const int tp_rank = g.tp->getRank();
    for (const auto& [name, value] : result.weights) {
      SCOPED_TRACE(fmt::format("rank {} ({}): {}", g.rank, g.mesh.describe(), name));
      EXPECT_ADAMW_PARAMS_CLOSE(value, tp_piece(name, want.at(name), tp_rank, g.tp->getSize()),
                                o.steps, o.lr);
    }
    EXPECT_TENSOR_CLOSE(torch::tensor(result.losses), torch::tensor(want_losses), kFp32Steps);
    ASSERT_EQ(result.grad_norms.size(), 3u);
    EXPECT_NEAR(result.grad_norms[0], 2 * o.clip, 1e-5 * o.clip);
    test::expect_digest_close(result.digest, want_digest);
  });
}

// One mesh per kind of step (the gradients of every mesh are L11OneStep's): tied and untied,
// interleaved, ZB-H1, cp under tp, ZeRO 1-3, HSDP, sequence parallelism with interleaving and
// full recomputation.
INSTANTIATE_TEST_SUITE_P(Meshes, L11Train,
                         ::testing::Values(kMeshes[0], kMeshes[1], kMeshes[2], kMeshes[3],
                                           kMeshes[8], kMeshes[13], kMeshes[17], kMeshes[18],
                                           kMeshes[19], kMeshes[24]),
                         [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// The traffic: what each rank sends, over each kind of group, is its closed form
// ---------------------------------------------------------------------------------------------

class L11Wire : public ::testing::TestWithParam<MeshCase> {};

// Two steps with clipping on every rank: the bytes its groups' recorders saw on the wire per
// step (the given RecordingComms, outside the learner's code) are predict_wire_bytes()' closed
// forms, whose group sizes are the mix's degrees: a gradient reduction over other ranks than dp
// x cp, a tied embedding summed twice or with the wrong tensor, a norm reduced parameter by
// parameter or over another group: each sends other bytes.
TEST_P(L11Wire, EachRanksBytesPerStepAreTheClosedForms) {
  NdOptions o = options_of(GetParam());
  o.steps = 1;  // every step sends the same (ZeRO-3's gather included)
  o.clip = 1.0;
  on_mesh(o, [&](const NdGroups& g) {
    const l11::NdResult result = l11::train_nd(o, g);
    for (const char* traffic : {"tp", "pp", "cp", "dp", "embedding", "norm"}) {
      SCOPED_TRACE(fmt::format("rank {} ({}): {} traffic", g.rank, g.mesh.describe(), traffic));
      ASSERT_EQ(result.wire_bytes.count(traffic), 1u);
      const l11::WireBytes& w = result.wire_bytes.at(traffic);
      EXPECT_NEAR(w.measured, w.predicted, 1e-9 * std::max(1.0, w.predicted)) << w.formula;
    }
    // Each degree above 1 sends something: the closed forms are not zero where they must not be.
    const auto bytes = [&](const char* t) { return result.wire_bytes.at(t).predicted; };
    const MixSpec& mix = o.mix;
    EXPECT_EQ(bytes("tp") > 0, mix.tp > 1);
    EXPECT_EQ(bytes("pp") > 0, mix.pp > 1);
    EXPECT_EQ(bytes("cp") > 0, mix.cp > 1);
    EXPECT_EQ(bytes("dp") > 0, mix.dp * mix.cp > 1);
    const int64_t replicas = mix.shard > 0 ? mix.dp / mix.shard : 1;
    EXPECT_EQ(bytes("norm") > 0,
              (mix.zero_stage > 0 ? mix.world() / replicas : mix.pp * mix.tp) > 1);
    // the first and the last stage of a pipeline (the given embedding group's two ranks)
    EXPECT_EQ(bytes("embedding") > 0, o.model.tied && g.embedding);
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, L11Wire,
                         ::testing::Values(kMeshes[0], kMeshes[2], kMeshes[3], kMeshes[4],
                                           kMeshes[7], kMeshes[8], kMeshes[9], kMeshes[10],
                                           kMeshes[11], kMeshes[12], kMeshes[13], kMeshes[15],
                                           kMeshes[18], kMeshes[19], kMeshes[21], kMeshes[22],
                                           kMeshes[23], kMeshes[24]),
                         [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// ZeRO-1: the optimizer's state is the rank's shard
// ---------------------------------------------------------------------------------------------

// After a step, the moments AdamW keeps on each rank (read from the given optimizer's state) are
// 2 x its chunk of every parameter it holds, ceil(numel / n) elements or fewer at the end, n =
// dp x cp; without ZeRO, 2 x every element it holds. And the shards tile each parameter: the
// ranks of one (pp, tp) coordinate hold 2 x its elements between them, no more.
TEST(L11Zero, EachRankKeepsTheMomentsOfItsShardOnly) {
  for (const char* mix : {"2x2x2x1:1", "2x2x2x1", "1x1x2x2:1", "4x2x1x1:hsdp2"}) {
    NdOptions o = options_of(MeshCase{mix, mix, l09::ScheduleKind::k1f1b, true});
    o.steps = 1;
    std::mutex mu;
    std::map<std::pair<int, int>, int64_t> per_piece;  // (pp, tp) -> moments summed over dp x cp
    std::map<std::pair<int, int>, int64_t> held;       // (pp, tp) -> elements one rank holds
    on_mesh(o, [&](const NdGroups& g) {
      const l11::NdResult result = l11::train_nd(o, g);
      const RankModel model = l11::build_rank_model(o, g);
      const std::vector<std::string> dims{"dp_shard", "cp"};
      const int64_t n = g.mesh.size(dims), r = g.mesh.coord(g.rank, dims);
      int64_t want = 0, whole = 0;
      for (const auto& p : l09::parameters_of(model.chunks)) {
        const int64_t chunk = (p.numel() + n - 1) / n;
        const int64_t mine = std::max<int64_t>(0, std::min(chunk, p.numel() - r * chunk));
        want += 2 * (o.mix.zero_stage > 0 ? mine : p.numel());
        whole += p.numel();
      }
      EXPECT_EQ(result.optimizer_elements, want) << mix << ", rank " << g.rank;
      std::lock_guard<std::mutex> lock(mu);
      const auto key = std::make_pair(g.mesh.coord(g.rank, "pp"), g.mesh.coord(g.rank, "tp"));
      per_piece[key] += result.optimizer_elements;
      held[key] = whole;
    });
    for (const auto& [key, moments] : per_piece) {
      // one copy of the moments per HSDP replica group; without ZeRO one per dp x cp rank
      const int64_t copies = o.mix.zero_stage > 0
                                 ? o.mix.dp / (o.mix.shard > 0 ? o.mix.shard : o.mix.dp)
                                 : o.mix.dp * o.mix.cp;
      EXPECT_EQ(moments, 2 * held.at(key) * copies) << mix << ", stage " << key.first;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The groups
// ---------------------------------------------------------------------------------------------

// The groups the learner chose, checked by their members on the mesh: the reduction's group is
// every rank with this rank's pp and tp coordinates (the same piece of the same parameters, seen
// on other tokens: dp x cp of them) and no other; the norm's group holds every (pp, tp) pair once,
// all of one dp replica and cp rank; under ZeRO-1, where each rank of dp x cp holds another shard,
// every rank of the world.
TEST(L11Groups, EachCollectiveRunsOnTheRanksThatNeedIt) {
  for (const char* text :
       {"2x2x2x1", "4x1x2x1", "1x2x4x1", "2x1x1x1", "8x1x1x1", "2x2x1x2", "1x2x2x2", "1x1x1x4",
        "2x2x2x1:1", "1x2x2x2:1", "1x1x1x4:1", "8x1x1x1:1", "2x1x4x1:1", "2x2x2x1:3",
        "4x2x1x1:hsdp2", "8x1x1x1:hsdp4", "4x1x2x1:hsdp2"}) {
    const MixSpec mix = parse_mix(text, "--mix");
    const Mesh mesh = l11::make_mesh(mix, static_cast<int>(mix.world()));
    const l11::Reduction r = l11::gradient_reduction(mesh);
    const std::vector<std::string> n = l11::norm_dims(mesh, mix.zero_stage);
    for (int rank = 0; rank < mesh.world(); ++rank) {
      SCOPED_TRACE(fmt::format("{}, rank {}", text, rank));
      const auto reduce = mesh.group(rank, r.dims);
      EXPECT_EQ(static_cast<int64_t>(reduce.size()), mix.dp * mix.cp)
          << "the reduction's group: every rank that holds this rank's piece, and no other";
      for (int other : reduce) {
        EXPECT_EQ(mesh.coord(other, "pp"), mesh.coord(rank, "pp"));
        EXPECT_EQ(mesh.coord(other, "tp"), mesh.coord(rank, "tp"));
      }
      EXPECT_EQ(r.divisor, mix.dp * mix.cp)
          << "the sum over the group, divided once by the parts the tokens were cut into";
      const auto norm = mesh.group(rank, n);
      if (mix.zero_stage > 0) {
        const int64_t replicas = mix.shard > 0 ? mix.dp / mix.shard : 1;
        EXPECT_EQ(static_cast<int64_t>(norm.size()), mix.world() / replicas)
            << "the norm's group under ZeRO: every rank of one HSDP replica group (each dp_shard "
               "x cp rank holds another shard; the groups hold the same ones)";
        for (int other : norm) {
          EXPECT_EQ(mesh.coord(other, "dp_replicate"), mesh.coord(rank, "dp_replicate"));
        }
        continue;
      }
      EXPECT_EQ(static_cast<int64_t>(norm.size()), mix.pp * mix.tp)
          << "the norm's group: every stage and tp rank once, one replica";
      for (int other : norm) {
        EXPECT_EQ(mesh.coord(other, "dp_replicate"), mesh.coord(rank, "dp_replicate"));
        EXPECT_EQ(mesh.coord(other, "cp"), mesh.coord(rank, "cp"));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Memory: rank 0's state against lesson 01's ledger for the same mix
// ---------------------------------------------------------------------------------------------

class L11Memory : public ::testing::TestWithParam<MeshCase> {};

// After one step, rank 0 (the first stage, the ledger's device) holds, to the byte, the ledger's
// fp32 AdamW state plus what the ledger does not model, counted here from the model's shapes:
// tp replicates the LayerNorms, the row-parallel biases and the embeddings, which the ledger
// divides by tp; a one-stage pipeline keeps the head as a second tensor (the tied copy, or
// lm_head). Under ZeRO its moments are 2 x 4 bytes of its chunk ceil(numel / n) of every piece
// (n = dp_shard x cp), and at rest, after the step, so are ZeRO-2's gradients and ZeRO-3's
// parameters too: their whole tensors' storage is counted at the bytes it still holds.
TEST_P(L11Memory, RankZerosStateIsTheLedgersPlusWhatItDoesNotModel) {
  NdOptions o = options_of(GetParam());
  o.steps = 1;
  const int zero = o.mix.zero_stage;
  const int64_t tp = o.mix.tp, pp = o.mix.pp;
  const int64_t n = (o.mix.shard > 0 ? o.mix.shard : o.mix.dp) * o.mix.cp;
  // Rank 0's pieces, by numel: the embeddings, ceil(L / pp) blocks, and on one stage the rest.
  std::vector<int64_t> pieces;
  std::vector<int64_t> unsplit;  // the same, as the ledger counts them (before its / tp)
  const int64_t blocks = (o.model.layers + pp - 1) / pp;
  for (const auto& item : Gpt(o.model)->named_parameters()) {
    const std::string& name = item.key();
    const bool split = split_over_tp(name);
    bool held = name.rfind("wte.", 0) == 0 || name.rfind("wpe.", 0) == 0;
    if (name.rfind("h.", 0) == 0) held = std::stoi(name.substr(2)) < blocks;
    if (name.rfind("ln_f.", 0) == 0) held = pp == 1;
    if (!held) continue;
    pieces.push_back(split ? item.value().numel() / tp : item.value().numel());
    unsplit.push_back(item.value().numel());
  }
  if (pp == 1) pieces.push_back(o.model.vocab * o.model.hidden);  // the head: a second tensor
  int64_t held = 0, ledger_elements = 0, zero_chunks = 0;
  for (int64_t k : pieces) {
    held += k;
    zero_chunks += (k + n - 1) / n;
  }
  for (int64_t k : unsplit) ledger_elements += k;

  const l01::ModelConfig model{"run",          l01::Arch::kGpt, o.model.hidden,
                               o.model.layers, o.model.heads,   o.model.heads,
                               o.model.ffn(),  o.model.vocab,   o.model.ctx};
  l01::TrainingSetup setup;
  setup.precision = l01::Precision::kFp32;
  setup.optimizer = l01::Optimizer::kAdam;
  setup.zero_stage = o.mix.zero_stage;
  setup.dp = n;
  setup.tp = tp;
  setup.pp = pp;
  const l01::Ledger ledger = l01::compute_ledger(l01::count_params(model), setup, &model);
  // The ledger's documented model: rank 0's blocks and embeddings (pp 1: the whole tied model),
  // every one split by tp, and by n under ZeRO-3.
  EXPECT_DOUBLE_EQ(ledger.state.params,
                   4.0 * static_cast<double>(ledger_elements) / tp / (zero >= 3 ? n : 1));

  on_mesh(o, [&](const NdGroups& g) {
    const l11::NdResult result = l11::train_nd(o, g);
    if (g.rank != 0) return;
    const int64_t whole = 4 * held, shard = 4 * zero_chunks;
    EXPECT_EQ(result.memory.params, zero >= 3 ? shard : whole)
        << "ZeRO-3 keeps its shard of the parameters between steps";
    EXPECT_EQ(result.memory.grads, zero >= 2 ? shard : whole)
        << "ZeRO-2 and 3 keep their shard of the gradients between steps, ZeRO-1 every one whole";
    const double replicated =
        static_cast<double>(whole) - ledger.state.params * (zero >= 3 ? n : 1);
    EXPECT_GE(replicated, 0) << "the ledger's even split by tp is the least rank 0 can hold";
    if (tp == 1 && pp > 1) EXPECT_EQ(replicated, 0) << "no tp, no second head: the ledger's";
    if (zero == 0) {
      EXPECT_EQ(result.memory.optimizer, 8 * held);
      EXPECT_EQ(result.memory.zero_copies, 0);
    } else {
      EXPECT_EQ(result.memory.optimizer, 2 * shard);
      EXPECT_EQ(result.memory.zero_copies, zero == 1   ? 2 * shard
                                           : zero == 2 ? shard
                                                       : 0)
          << "ZeRO-1: the shards' copies and their gradients; ZeRO-2: the copies";
      EXPECT_GE(static_cast<double>(result.memory.optimizer), ledger.state.optimizer);
      if (zero >= 2) EXPECT_GE(static_cast<double>(result.memory.grads), ledger.state.grads);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Meshes, L11Memory,
                         ::testing::Values(kMeshes[0], kMeshes[2], kMeshes[4], kMeshes[6],
                                           kMeshes[8], kMeshes[13], kMeshes[14], kMeshes[16],
                                           kMeshes[17], kMeshes[18], kMeshes[19]),
                         [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// bf16: the composition in bf16 with fp32 master weights, held to the course's bf16 policy
// ---------------------------------------------------------------------------------------------

class L11Bf16 : public ::testing::TestWithParam<MeshCase> {};

// Six steps of a bf16 model with fp32 master weights (MasterAdamW; under ZeRO the fp32 shards),
// against the single device's bf16 and fp32 runs, by lessons 02, 08 and 09's policy: the noise
// floor is rho(bf16 baseline, fp32 baseline), rho = |w - r| / |r - w0| over every weight once
// (dp replica 0, cp rank 0, a tp-whole weight from tp rank 0, as the digest takes them); the run
// lands within 1.5 of the floor from the bf16 baseline and at least 0.25 of it from the fp32
// one, so an fp32 run cannot pass. The run rounds where one device does not: the row-parallel
// partial sums, and each micro-batch's gradient, added into a bf16 gradient (lesson 09's
// scheme). And each rank's bytes per step are the closed forms with e = 2.
TEST_P(L11Bf16, TheMasterWeightsAreWithinTheBf16Policy) {
  if (!kGlooBf16) GTEST_SKIP() << "LibTorch 1.13's gloo has no bf16 collectives";
  NdOptions o = options_of(GetParam());
  o.steps = 6;
  const auto fp32 = one_device_train(o, o.steps, 0, 2);
  const auto w0 = one_device_train(o, 0, 0, 2);
  NdOptions b = o;
  b.precision = Precision::kBf16;
  std::vector<float> bf16_losses;
  const auto bf16 = one_device_train(b, b.steps, 0, 2, nullptr, &bf16_losses);
  test::RhoSums between;
  for (const auto& [name, w] : fp32) between.add(bf16.at(name), w, w, w0.at(name));
  const double floor = between.rho_bf16();
  std::mutex mu;
  test::RhoSums sums;
  std::vector<float> losses;
  on_mesh(b, [&](const NdGroups& g) {
    const l11::NdResult result = l11::train_nd(b, g);
    for (const auto& [traffic, bytes] : result.wire_bytes) {  // e = 2 where bf16 is sent
      EXPECT_NEAR(bytes.measured, bytes.predicted, 1e-9 * std::max(1.0, bytes.predicted))
          << "rank " << g.rank << ", " << traffic << " traffic in bf16: " << bytes.formula;
    }
    const bool first_replica =
        g.mesh.coord(g.rank, std::vector<std::string>{"dp_replicate", "dp_shard", "cp"}) == 0;
    const int tp = g.tp->getSize(), tp_rank = g.tp->getRank();
    test::RhoSums mine;
    for (const auto& item : result.weights) {
      const std::string& name = item.first;
      const torch::Tensor& w = item.second;
      ASSERT_EQ(w.scalar_type(), torch::kFloat) << name << ": the fp32 master weight";
      if (!first_replica || (tp_rank != 0 && !(tp > 1 && l11::tp_sharded(name)))) continue;
      const auto piece = [&](const std::map<std::string, torch::Tensor>& all) {
        return tp_piece(name, all.at(name), tp_rank, tp);
      };
      mine.add(w, piece(bf16), piece(fp32), piece(w0));
    }
    std::lock_guard<std::mutex> lock(mu);
    sums.add(mine);
    if (g.rank == 0) losses = result.losses;
  });
  test::expect_bf16_policy(sums, floor, test::kOtherRounding, losses, bf16_losses, GetParam().name);
}

INSTANTIATE_TEST_SUITE_P(Meshes, L11Bf16,
                         ::testing::Values(kMeshes[0], kMeshes[18], kMeshes[19], kMeshes[21]),
                         [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// The activations each rank holds when its first backward starts
// ---------------------------------------------------------------------------------------------

class L11Activations : public ::testing::TestWithParam<MeshCase> {};

// Every rank's bytes held by its forwards when its first backward starts (the given forward's
// observer and this thread's counting allocator, from outside your code) are the closed form of
// README section 7 for its pipeline rank: the blocks' saved tensors (lessons 02 and 10) times the
// forwards its schedule runs first (min(m, p - s) under 1F1B, the warm-up of the interleaved
// schedule), the output each chunk keeps, the head's tensors and the positions. Besides, whole
// messages of 4 b (s/cp) h bytes: the reference executor receives at most two ahead (lesson 09),
// and a send holds what it sends (a contiguous copy, for an output that is not contiguous) until
// the peer has taken it, which on a loaded machine can be after this rank's first backward: at
// most one per forward of the step. (Two was the bound until a loaded run with Ulysses held
// three; which buffer was the third was not established.)
TEST_P(L11Activations, EachRankHoldsTheClosedFormWhenItsFirstBackwardStarts) {
  install_counting_allocator();
  NdOptions o = options_of(GetParam());
  o.steps = 1;
  std::mutex mu;
  std::map<int, std::pair<int64_t, int>> held;  // rank -> (bytes measured, pipeline rank)
  on_mesh(o, [&](const NdGroups& g) {
    const l11::NdResult result = l11::train_nd(o, g);
    std::lock_guard<std::mutex> lock(mu);
    held[g.rank] = {result.activation_bytes, g.mesh.coord(g.rank, "pp")};
  });
  const int64_t message = 4 * o.mix.micro_batch * o.model.ctx / o.mix.cp * o.model.hidden;
  ASSERT_EQ(held.size(), static_cast<size_t>(o.mix.world()));
  for (const auto& [rank, h] : held) {
    const int64_t want = l11::predict_activation_bytes(o, h.second);
    ASSERT_GT(want, 0) << "a closed form for " << GetParam().name;
    const int64_t ahead = h.first - want;
    const int64_t most = (2 + l11::micro_batches(o) * o.mix.virtual_stages) * message;
    EXPECT_TRUE(ahead >= 0 && ahead <= most && ahead % message == 0)
        << "rank " << rank << " (stage " << h.second << ") of " << o.mix.text() << ": held "
        << h.first << " bytes, the closed form " << want << ", messages of " << message;
  }
}

INSTANTIATE_TEST_SUITE_P(Meshes, L11Activations,
                         ::testing::Values(kMeshes[0], kMeshes[2], kMeshes[3], kMeshes[4],
                                           kMeshes[5], kMeshes[9], kMeshes[10], kMeshes[18]),
                         [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// The traffic against lesson 01's planner (step_bytes_per_gpu) for the same mix
// ---------------------------------------------------------------------------------------------

class L11PlannerTraffic : public ::testing::TestWithParam<MeshCase> {};

// Each rank's recorded bytes per step (the given RecordingComms, after two steps through the
// learner's groups) are the planner's terms for the same mix, converted by exactly what the
// planner does not model (README section 7), and nothing else:
//   tp: the planner's 16-bit activations; this run is fp32: x 2; the planner's sequence
//       parallelism sends 10 collectives of (tp-1)/tp a block (14 recomputed), this plain TP 4
//       (6) allreduces: x 4/5 (6/7);
//   pp: x 2 (fp32), x tp (every tp rank sends the whole activation; the planner scatters it),
//       x 1/2 on the first and last stage (one direction each), + the loss's allreduce;
//   cp (all-gather attention): x 2 (fp32), + the loss's allreduce;
//   dp: the planner's P / (tp pp) a rank is an average; summed over one replica's pp x tp ranks
//       the ranks reduce P, plus the (tp - 1) extra copies of every parameter tp keeps whole and
//       the tied head's copy on each tp rank of the last stage (the planner's tied GPT counts it
//       once), + the loss's allreduce on each rank. Under ZeRO-3 this lesson reduces and gathers
//       once a step (torchtitan's FSDP under pp): ZeRO-1's bytes, where the planner costs the
//       ZeRO paper's per-micro-batch gathers and reduce-scatters, m (2w + g) / (w + g) times more.
TEST_P(L11PlannerTraffic, TheRecordedBytesAreThePlannersTermsConverted) {
  NdOptions o = options_of(GetParam());
  o.steps = 2;
  ASSERT_TRUE(o.model.tied) << "the dp sum below counts the tied head's copy";
  ASSERT_FALSE(o.sequence_parallel) << "the tp factor below is plain TP's";
  const MixSpec& x = o.mix;
  const int64_t tp = x.tp, pp = x.pp, cp = x.cp, dp = x.dp;
  l01::PlanRequest req;
  req.model = l01::ModelConfig{"run",          l01::Arch::kGpt, o.model.hidden,
                               o.model.layers, o.model.heads,   o.model.heads,
                               o.model.ffn(),  o.model.vocab,   o.model.ctx};
  req.setup.precision = l01::Precision::kFp32;
  req.setup.optimizer = l01::Optimizer::kAdam;
  req.setup.seq = o.model.ctx;
  req.gpus = x.world();
  req.global_batch = o.batch;
  l01::Mix mix;
  mix.dp = dp;
  mix.tp = tp;
  mix.pp = pp;
  mix.cp = cp;
  mix.zero_stage = x.zero_stage;
  mix.micro_batch = x.micro_batch;
  mix.recompute = x.recompute == "full" ? l01::Recompute::kFull : l01::Recompute::kNone;
  const auto planner = [&](l01::Strategy s) { return l01::step_bytes_per_gpu(s, req, mix); };
  const auto ring = [](int64_t n) { return 2.0 * static_cast<double>(n - 1) / n; };
  const double loss = 4;  // one fp32 number

  // The parameters the planner does not see: tp's whole copies and the tied head's copy.
  int64_t whole = 0;
  for (const auto& item : Gpt(o.model)->named_parameters()) {
    const std::string& name = item.key();
    const bool split = split_over_tp(name);
    if (!split) whole += item.value().numel();
  }
  const double extra = static_cast<double>((tp - 1) * whole + tp * o.model.vocab * o.model.hidden);

  std::mutex mu;
  std::map<int, std::map<std::string, double>> bytes;  // rank -> traffic -> measured per step
  on_mesh(o, [&](const NdGroups& g) {
    const l11::NdResult result = l11::train_nd(o, g);
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [traffic, w] : result.wire_bytes) bytes[g.rank][traffic] = w.measured;
  });
  const Mesh mesh = l11::make_mesh(x, static_cast<int>(x.world()));
  double replica_dp = 0;
  for (const auto& [rank, measured] : bytes) {
    SCOPED_TRACE(fmt::format("rank {} of {}", rank, x.text()));
    const double plain_tp = x.recompute == "full" ? 6.0 / 7 : 4.0 / 5;
    EXPECT_DOUBLE_EQ(measured.at("tp"), 2 * plain_tp * planner(l01::Strategy::kTp));
    if (pp > 1) {
      const int stage = mesh.coord(rank, "pp");
      const double sends = stage == 0 || stage == pp - 1 ? 1 : 2;
      EXPECT_DOUBLE_EQ(measured.at("pp"),
                       2 * tp * sends / 2 * planner(l01::Strategy::kPp) + ring(pp) * loss);
    }
    if (cp > 1) {
      EXPECT_DOUBLE_EQ(measured.at("cp"), 2 * planner(l01::Strategy::kCp) + ring(cp) * loss);
    }
    if (mesh.coord(rank, std::vector<std::string>{"dp_replicate", "dp_shard", "cp"}) == 0) {
      replica_dp += measured.at("dp");
    }
  }
  // Under ZeRO the planner's ZeRO-1 form: the reduce-scatter and the all-gather once a step.
  const l01::Strategy dp_term = x.zero_stage > 0 ? l01::Strategy::kZero1 : l01::Strategy::kDdp;
  const int64_t n = dp * cp;
  EXPECT_NEAR(replica_dp,
              static_cast<double>(tp * pp) * planner(dp_term) + ring(n) * 4 * extra +
                  static_cast<double>(tp * pp) * ring(dp) * loss,
              1e-6 * replica_dp)
      << "one replica's dp bytes: the planner's P plus the copies it does not count";
  if (x.zero_stage == 3) {
    const double m = static_cast<double>(l11::micro_batches(o));
    EXPECT_DOUBLE_EQ(planner(l01::Strategy::kZero3), m * 3 / 2 * planner(l01::Strategy::kZero1))
        << "the planner's ZeRO-3 (g = w = 4): m (2w + g) / (w + g) times this lesson's bytes";
  }
}

INSTANTIATE_TEST_SUITE_P(Meshes, L11PlannerTraffic,
                         ::testing::Values(kMeshes[0], kMeshes[11], kMeshes[13], kMeshes[18]),
                         [](const auto& info) { return std::string(info.param.name); });

// ---------------------------------------------------------------------------------------------
// Lesson 01's planner: what it picks for the course's own GPT on the course's own cluster runs
// ---------------------------------------------------------------------------------------------

// The ledger's preset course-gpt is the model this lesson trains (GptConfig's defaults): the
// planner costs the parameters the ranks hold.
TEST(L11PlannerGiven, TheLedgersCourseGptIsTheModelThatRuns) {
  const l01::ModelConfig m = l01::preset("course-gpt");
  const GptConfig g;
  EXPECT_EQ(m.hidden, g.hidden);
  EXPECT_EQ(m.layers, g.layers);
  EXPECT_EQ(m.heads, g.heads);
  EXPECT_EQ(m.ffn, g.ffn());
  EXPECT_EQ(m.vocab, g.vocab);
  EXPECT_EQ(m.ctx, g.ctx);
  Gpt model(g);
  int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  EXPECT_EQ(l01::count_params(m), numel);
}

class L11Planner : public ::testing::TestWithParam<int> {};

// `lesson01 --plan --model course-gpt --cluster course-cpu --precision fp32 --seq 64
// --global-batch 8 --gpus N`: the mix it picks, as lesson 11's --mix, trains two steps on N
// thread-ranks to the single device's parameters.
TEST_P(L11Planner, ThePlansPickTrainsToTheSingleDevicesParameters) {
  l01::PlanRequest req;
  req.model = l01::preset("course-gpt");
  req.setup.precision = l01::Precision::kFp32;
  req.setup.seq = 64;
  req.cluster = l01::cluster_preset("course-cpu");
  req.gpus = GetParam();
  req.global_batch = 8;
  l01::validate(req);
  const l01::Plan plan = l01::plan(req);
  ASSERT_TRUE(plan.fits);
  const l01::Mix& m = plan.eval.mix;
  SCOPED_TRACE(fmt::format("the plan's mix: {}x{}x{}x{}:{}:{}:{}:{}", m.dp, m.tp, m.pp, m.cp,
                           m.zero_stage, static_cast<int>(m.recompute), m.micro_batch,
                           m.virtual_stages));
  EXPECT_GT(m.tp * m.pp * m.cp, 1)
      << "8 MiB a rank does not hold the whole model with its fp32 AdamW states: it is split";
  NdOptions o;
  o.model = GptConfig{};
  o.batch = req.global_batch;
  o.seed = 5;
  o.steps = 2;
  o.digest = true;
  o.mix.dp = m.dp;
  o.mix.tp = m.tp;
  o.mix.pp = m.pp;
  o.mix.cp = m.cp;
  o.mix.zero_stage = m.zero_stage;
  o.mix.shard = m.shard;
  o.mix.recompute = m.recompute == l01::Recompute::kNone   ? "none"
                    : m.recompute == l01::Recompute::kFull ? "full"
                                                           : "selective";
  o.mix.micro_batch = m.micro_batch;
  o.mix.virtual_stages = m.virtual_stages;
  nlohmann::json want_digest;
  const auto want = one_device_train(o, o.steps, 0, 2, &want_digest);
  on_mesh(o, [&](const NdGroups& g) {
    const l11::NdResult result = l11::train_nd(o, g);
    ASSERT_FALSE(result.weights.empty());
    for (const auto& [name, value] : result.weights) {
      SCOPED_TRACE(fmt::format("rank {} ({}): {}", g.rank, g.mesh.describe(), name));
      EXPECT_ADAMW_PARAMS_CLOSE(
          value, tp_piece(name, want.at(name), g.tp->getRank(), g.tp->getSize()), o.steps, o.lr);
    }
    test::expect_digest_close(result.digest, want_digest);
  });
}

INSTANTIATE_TEST_SUITE_P(Gpus, L11Planner, ::testing::Values(4, 8),
                         [](const auto& info) { return fmt::format("gpus{}", info.param); });

}  // namespace
}  // namespace dtc
