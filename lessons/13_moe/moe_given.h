// Lesson 13, given: the MoE layer's configuration, its router, its experts, the single-device
// MoE (the lesson's baseline), the model and the training loop. moe.h says what the layer
// computes; the parallel parts are yours, in moe.cpp.
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtc/dist.h"
#include "dtc/mesh.h"
#include "dtc/model.h"
#include "dtc/observe.h"

namespace dtc::l13 {

// ---------------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------------

enum class ScoreFunc {
  kSoftmax,  ///< softmax over the E logits (Switch, GShard, Mixtral)
  kSigmoid,  ///< each logit's sigmoid (DeepSeek-V3; torchtitan's default)
};
const char* score_func_name(ScoreFunc f);

enum class Balance {
  kNone,  ///< no balancing: watch the router collapse
  kAux,   ///< Switch/GShard's auxiliary loss, --aux-loss-coef
  kBias,  ///< DeepSeek-V3's auxiliary-loss-free expert bias, --bias-rate
};
const char* balance_name(Balance b);

/// The MoE layer that replaces every block's MLP.
struct MoeConfig {
  int64_t experts = 4;                    ///< E, routed experts per layer (--experts)
  int64_t top_k = 2;                      ///< k, experts per token (--top-k)
  int64_t shared = 0;                     ///< S, shared experts every token goes through (one dense
                                          ///< FFN S x 4h wide; --shared-experts)
  ScoreFunc score = ScoreFunc::kSoftmax;  ///< --score-func
  bool route_norm = false;                ///< --route-norm: the k weights divided by their sum
  double capacity_factor = 0;             ///< --capacity-factor; 0: dropless
  Balance balance = Balance::kAux;        ///< --balance
  double aux_coef = 1e-2;                 ///< --aux-loss-coef (Switch's alpha)
  double z_coef = 0;                      ///< --z-loss-coef (ST-MoE uses 1e-3)
  double bias_rate = 1e-3;                ///< --bias-rate (DeepSeek-V3's gamma)
};

/// Checks @p c on its own and against @p world ranks, @p ep and the global batch, before any
/// networking. @throws UsageError naming the flag: --experts below 1, --top-k outside [1, E],
/// --ep not dividing E or the world, --capacity-factor below 0, a negative coefficient or rate,
/// --shared-experts below 0.
void check_moe(const MoeConfig& c, int world, int ep);

/// The expert capacity for @p tokens tokens: ceil(capacity_factor * tokens * k / E), or -1 when
/// dropless.
int64_t expert_capacity(const MoeConfig& c, int64_t tokens);

/// Whether the parameter called @p name ("h.1.mlp.experts.c_fc.weight") is a routed expert's,
/// held by one ep rank, or replicated on every rank.
bool is_expert(const std::string& name);

// ---------------------------------------------------------------------------------------------
// The router (given)
// ---------------------------------------------------------------------------------------------

/// Where one forward sends this rank's N tokens.
struct Routing {
  torch::Tensor experts;  ///< (N, k) int64: each token's chosen experts, in order of choice
  torch::Tensor weights;  ///< (N, k) float: their router weights (with autograd to the router)
  torch::Tensor keep;     ///< (N, k) bool: within capacity (all true when dropless)
};

/// What a layer's router saw, for the losses and the report.
struct RouterStats {
  torch::Tensor logits;  ///< (N, E) fp32, with autograd: the z-loss's input
  torch::Tensor shares;  ///< (N, E) fp32, with autograd: each expert's share of the token's scores
                         ///< (softmax: the probabilities; sigmoid: the scores over their sum)
  torch::Tensor counts;  ///< (E,) int64: this rank's choices per expert, before any drop
  torch::Tensor kept;    ///< (E,) int64: the choices kept within capacity
};

/// The router of moe.h for the tokens @p x (N, h): logits in fp32 through @p router_weight (E, h),
/// scores, top-k of scores + @p bias (E,), weights, capacity. Fills @p stats.
Routing route(const torch::Tensor& x, const torch::Tensor& router_weight, const torch::Tensor& bias,
              const MoeConfig& c, RouterStats& stats);

// ---------------------------------------------------------------------------------------------
// The experts (given)
// ---------------------------------------------------------------------------------------------

/// n linear maps of one shape stacked: weight (n, out, in), bias (n, out).
class StackedLinearImpl : public torch::nn::Module {
 public:
  StackedLinearImpl(int64_t n, int64_t in, int64_t out);
  torch::Tensor weight;
  torch::Tensor bias;
};
TORCH_MODULE(StackedLinear);

/// A block's routed experts, or an ep rank's share of them: experts [first, first + count) of E.
class ExpertsImpl : public torch::nn::Module {
 public:
  ExpertsImpl(int64_t count, int64_t hidden, int64_t ffn, int64_t first = 0);
  /// The experts over @p tokens (M, h) grouped by expert: rows [sum(tokens_per_expert[0..j)),
  /// + tokens_per_expert[j]) through expert first + j (a loop of dense matmuls: on GPUs, one
  /// grouped GEMM). An expert with no rows still runs, on none. -> (M, h)
  torch::Tensor forward(const torch::Tensor& tokens, const std::vector<int64_t>& tokens_per_expert);
  /// The held expert @p j on @p x (M, h): c_proj(GELU(c_fc(x))), c_proj's bias added unless
  /// @p proj_bias is false (tensor-parallel experts add it once, on the token's rank).
  torch::Tensor run(int64_t j, const torch::Tensor& x, bool proj_bias = true);
  /// Keeps experts [first, first + count) of the ones held (this ep rank's), dropping the others.
  void keep(int64_t first, int64_t count);
  int64_t first() const { return first_; }
  int64_t count() const { return c_fc->weight.size(0); }

  StackedLinear c_fc{nullptr};    ///< (count, 4h, h)
  StackedLinear c_proj{nullptr};  ///< (count, h, 4h)

 private:
  int64_t first_ = 0;
};
TORCH_MODULE(Experts);

/// A dense FFN h -> width -> h (GELU): the shared experts.
class FfnImpl : public torch::nn::Module {
 public:
  FfnImpl(int64_t hidden, int64_t width);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear c_fc{nullptr};
  torch::nn::Linear c_proj{nullptr};
};
TORCH_MODULE(Ffn);

// ---------------------------------------------------------------------------------------------
// The MoE layer: single-device (the baseline) or expert-parallel (your dispatch and combine)
// ---------------------------------------------------------------------------------------------

/// One block's MoE layer, x (B, T, h) -> (B, T, h). Without an ep group (or one of size 1) it is
/// the single-device MoE of moe.h, computed expert by expert from the routing (the lesson's
/// baseline: tests/lesson13 checks it against PyTorch). With one, its experts are this ep rank's
/// and forward() runs route -> dispatch -> experts -> combine (moe.cpp).
class MoeLayerImpl : public torch::nn::Module {
 public:
  MoeLayerImpl(const GptConfig& model, const MoeConfig& moe);
  torch::Tensor forward(const torch::Tensor& x);
  /// Keeps this ep rank's experts and routes through @p ep from now on.
  void shard_experts(Comm* ep);
  /// The contrast: tensor-parallel experts over @p group (P ranks). Keeps this rank's 1/P slice
  /// of every expert's hidden width (c_fc's rows and bias, c_proj's columns; c_proj's bias
  /// whole). forward() then gathers the group's tokens and their routing (an all-gather), runs
  /// its slice of every chosen expert on all of them, and sends each token's partial outputs back
  /// to its rank (a reduce-scatter), which adds them and the c_proj bias. Given code, not a
  /// training mode: the program and the tests compare its bytes and memory with ep's.
  /// @throws c10::Error when P does not divide 4h
  void split_experts(Comm* group);

  torch::nn::Linear router{nullptr};  ///< (E, h), no bias
  Experts experts{nullptr};
  Ffn shared{nullptr};        ///< only with --shared-experts
  torch::Tensor expert_bias;  ///< (E,) buffer: --balance bias's routing bias
  RouterStats stats;          ///< the last forward's
  /// Called with what this rank's experts are given in each forward (the rows grouped by local
  /// expert, and how many each takes), for tests that observe the work from outside.
  std::function<void(const torch::Tensor& tokens, const std::vector<int64_t>& tokens_per_expert)>
      on_experts;

 private:
  MoeConfig moe_;
  Comm* ep_ = nullptr;
  Comm* tp_ = nullptr;
};
TORCH_MODULE(MoeLayer);

/// The course's GPT with every block's MLP an MoE layer, its weights from @p seed (init_weights
/// by name: the experts' stacked weights as GPT-2's c_fc and c_proj, the router at std 0.02), all
/// E experts on this rank. MoeGpt::shard then keeps one ep rank's.
Gpt make_moe_gpt(const GptConfig& model, const MoeConfig& moe, uint64_t seed);

/// The MoE layer of block @p i.
MoeLayerImpl& moe_layer(Gpt& model, int64_t i);

/// Keeps ep rank @p ep->getRank()'s experts of every layer and routes through @p ep.
void shard_experts(Gpt& model, Comm* ep);

/// The rows of @p x (N, ...) of every rank of @p group, in rank order (P N, ...): an all-gather,
/// as an all-to-all of equal splits; its backward sums each row's P gradients back on its rank.
/// Every rank's N must be the same.
torch::Tensor gather_rows(const torch::Tensor& x, Comm& group);
/// The inverse: @p partial (P N, ...) holds a part of every rank's rows; returns this rank's N
/// rows summed over the group (a reduce-scatter, as an all-to-all); backward: gather_rows.
torch::Tensor scatter_sum(const torch::Tensor& partial, Comm& group);

// ---------------------------------------------------------------------------------------------
// Groups and training (given)
// ---------------------------------------------------------------------------------------------

/// This rank's communicators over moe_mesh() (dtc::MeshGroups, the course's one store-prefix
/// rule): data (every rank), ep (ep consecutive ranks), expert_data (the ranks with this rank's
/// experts, stride ep). Each is a RecordingComm over its group's, so that what went through it
/// can be counted.
struct MoeGroups {
  int rank = 0;
  int world = 1;
  int ep_size = 1;
  c10::intrusive_ptr<RecordingComm> data;
  c10::intrusive_ptr<RecordingComm> ep;
  c10::intrusive_ptr<RecordingComm> expert_data;
};

/// moe.h's mesh as a dtc::Mesh: dp_replicate W/ep (slower) x dp_shard ep (faster). The ep groups
/// are its dp_shard groups (ep consecutive ranks: torchtitan borrows ep from dp_shard), the
/// expert-data groups its dp_replicate groups, and the data group both.
/// @throws UsageError("--ep") when ep does not divide @p world
Mesh moe_mesh(int world, int ep);

/// The global ranks of @p rank's ep group and expert-data group (moe.h's mesh).
std::vector<int> ep_group(int rank, int world, int ep);
std::vector<int> expert_data_group(int rank, int world, int ep);

MoeGroups make_moe_groups(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, int ep,
                          BackendKind backend, std::chrono::milliseconds timeout,
                          const std::string& master_addr = "127.0.0.1");

/// One step's report, the same on every rank.
struct MoeStep {
  float loss = 0;                            ///< the global batch's mean of moe_loss
  std::vector<std::vector<int64_t>> counts;  ///< per layer, the global batch's choices per expert
  std::vector<std::vector<int64_t>> kept;    ///< per layer, of them kept within capacity
  double imbalance = 1;         ///< max over layers of (most tokens an ep rank computed / mean)
  double expert_imbalance = 1;  ///< max over layers of (most choices of an expert / mean)
};

/// Trains the MoE GPT on this rank's rows of each global batch (rows rank x B/W on), step by step:
/// forward, moe_loss, backward, reduce_gradients, AdamW, update_expert_bias (balance kBias).
class MoeTrainer {
 public:
  MoeTrainer(const RunConfig& run, const MoeConfig& moe, MoeGroups& groups,
             torch::Device device = torch::kCPU);
  MoeStep step(int64_t step);
  Gpt& model() { return model_; }
  /// This rank's parameters under the full model's names.
  std::vector<std::pair<std::string, torch::Tensor>> named_parameters() const;
  /// Every full-model parameter name, in order (for param_digest).
  const std::vector<std::string>& names() const { return names_; }
  /// The digest of the whole model, over every rank (each expert shard once).
  nlohmann::json digest();
  /// Called between backward and reduce_gradients (tests: one step's gradients).
  std::function<void()> after_backward;
  /// Called after reduce_gradients, before AdamW.
  std::function<void()> after_reduce;

 private:
  RunConfig run_;
  MoeConfig moe_;
  MoeGroups& g_;
  torch::Device device_;
  Gpt model_{nullptr};
  std::vector<std::string> names_;
  std::unique_ptr<torch::optim::AdamW> adamw_;
};

}  // namespace dtc::l13
