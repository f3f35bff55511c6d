// Lesson 13 contract: a mixture of experts in the course's GPT, and expert parallelism.
//
// Every block's MLP becomes an MoE layer (swapped in through BlockImpl::swap_mlp, so the other
// parameters keep their names and param_digest its meaning). For the N tokens x (N, h) a rank
// feeds it:
//
//   logits = x W_r^T (fp32; W_r: router.weight, (E, h), no bias)          the router
//   s      = softmax(logits) or sigmoid(logits)                            --score-func
//   chosen = top-k of (s + expert_bias) per token                          --top-k; the bias
//            (DeepSeek-V3's auxiliary-loss-free balancing, --balance bias) only picks experts
//   w      = s at the chosen experts, divided by their sum with --route-norm
//   y      = sum over the kept chosen experts e of w_e * expert_e(x)   (+ shared(x): S shared
//            experts, --shared-experts)
//   expert_e(x) = c_proj_e(GELU(c_fc_e(x))), h -> 4h -> h, each with a bias
//
// Dropless by default (--capacity-factor 0). With a capacity factor c > 0 each expert takes at
// most ceil(c N k / E) of one rank's N tokens' copies, first come (token order, then the k
// choices in order) first served; a copy over it is dropped: it contributes nothing, and the
// block's residual carries the token on (x + 0).
//
// The expert weights are stacked: h.{i}.mlp.experts.c_fc.weight (E, 4h, h), .bias (E, 4h),
// h.{i}.mlp.experts.c_proj.weight (E, h, 4h), .bias (E, h). Under expert parallelism over an ep
// group of size P, its rank p holds experts [p E/P, (p+1) E/P): rows of those tensors under the
// same names. Everything else (attention, LayerNorms, embeddings, the router, the expert bias,
// shared experts) is replicated on every rank.
//
// The mesh. ep never multiplies the world size: it is folded over the data-parallel ranks, as
// torchtitan and Megatron-Core do. Every one of the W = world ranks takes its own rows of the
// global batch (dp = W); the ep groups are W / ep blocks of ep consecutive ranks, and each of
// their ranks holds E/ep experts. The ranks that hold the same experts (rank % ep equal) form the
// expert-data-parallel group (edp, W / ep ranks), which replicates them.
//
//   rank = ep_rank + ep * edp_rank
//
// On the course's dtc::Mesh (moe_mesh()): dp_shard = ep, dp_replicate = W / ep; the ep group is a
// dp_shard group, the expert-data group a dp_replicate group, as torchtitan takes ep from dp_shard.
//
// What is yours (moe.cpp):
//
//   1. all_to_all(): the all-to-all with uneven split sizes, and its backward;
//   2. exchange_counts(): how many token copies each rank sends to each of my experts, before any
//      token moves;
//   3. dispatch() and combine(): the token copies to the ranks of their experts, grouped by local
//      expert, and the experts' results back, in place, weighted by the router;
//   4. reduce_gradients(): every gradient the single-device gradient of the global batch's loss,
//      expert and non-expert parameters over their own groups, each divided exactly once;
//   5. moe_loss(): the training loss: cross-entropy + Switch's load-balancing loss over the global
//      batch + the router z-loss;
//   6. update_expert_bias(): the auxiliary-loss-free bias step, the same on every rank.
//
// What must hold: after any number of steps (dropless), every rank's parameters are the
// single-device MoE's (MoeMlp below, itself checked against PyTorch), the router's choices the
// same step by step. README.md beside it teaches it; tests/lesson13/ checks it.
//
//   make test-lesson13
//   make run-lesson13 NPROC=4 ARGS="--experts 4 --top-k 2 --ep 2"
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dtc/dist.h"
#include "moe_given.h"

namespace dtc::l13 {

// ---------------------------------------------------------------------------------------------
// What you implement (moe.cpp)
// ---------------------------------------------------------------------------------------------

/// @brief The all-to-all with uneven splits, differentiable: rank r sends rows
///   [sum(send_splits[0..q)), + send_splits[q]) of @p x to rank q of @p comm, and receives
///   recv_splits[q] rows from each rank q, in rank order.
///
/// @p x is (sum(send_splits), ...) and the result (sum(recv_splits), ...) of the same trailing
/// shape and dtype. The gradient of the result is sent back the way it came: the backward is the
/// all-to-all with the two splits swapped. Zero rows to or from a rank (an expert no token
/// chose, a rank with no tokens) is an ordinary case. Every rank of @p comm calls it, with
/// send_splits[q] on rank r equal to recv_splits[r] on rank q.
torch::Tensor all_to_all(const torch::Tensor& x, const std::vector<int64_t>& send_splits,
                         const std::vector<int64_t>& recv_splits, Comm& comm);

/// @brief Before any token moves: every rank of the ep group @p ep learns how many token copies
///   each rank will send to each of its local experts.
///
/// @p send_counts is (E,) int64 on this rank: the copies it sends to each expert, in global
/// expert order (experts [q E/P, (q+1) E/P) live on ep rank q). Returns (P, E/P) int64: row q is
/// what ep rank q sends to each of this rank's E/P experts. One all-to-all over @p ep (the tests
/// count it: E/P int64 to each rank).
torch::Tensor exchange_counts(const torch::Tensor& send_counts, Comm& ep);

/// What dispatch() hands the local experts, and what combine() needs to undo it.
struct Dispatch {
  /// (M, h): the token copies this rank's experts compute, grouped by local expert (all of local
  /// expert 0's, then expert 1's, ...); within an expert, in any order combine() can undo.
  torch::Tensor tokens;
  /// (E/P,): rows of `tokens` per local expert, summing to M; what run_experts() takes.
  std::vector<int64_t> tokens_per_expert;

  // Yours, filled by dispatch() for combine(); the names are a suggestion.
  torch::Tensor copies;              ///< the kept copies' indices into the N x k choices, sent
                                     ///< in this order
  torch::Tensor regroup;             ///< row i of `tokens` is received row regroup[i]
  std::vector<int64_t> send_splits;  ///< copies sent to each ep rank
  std::vector<int64_t> recv_splits;  ///< copies received from each ep rank
};

/// @brief Sends every kept token copy (routing.keep) to the ep rank of its expert and groups what
///   this rank receives by local expert.
///
/// @p x is (N, h), this rank's tokens; copy (t, j) is token t's j-th choice,
/// routing.experts[t][j]. First the counts (exchange_counts), so that every rank knows what it
/// receives; then the copies, in one all_to_all() over @p ep. Copies that routing.keep drops are
/// not sent. @p experts is E (E/P per ep rank).
Dispatch dispatch(const torch::Tensor& x, const Routing& routing, int64_t experts, Comm& ep);

/// @brief The inverse of dispatch(): each expert's output row back to the rank and the token it
///   came from, weighted by its router weight, summed over the token's kept copies.
///
/// @p expert_out is (M, h), row i the expert's output for d.tokens's row i. Returns (N, h): for
/// token t, sum over its kept choices j of routing.weights[t][j] * that copy's output; zeros for
/// a token with no kept copy. The router weights are applied once, here; their gradient reaches
/// the router. One all_to_all() over @p ep.
torch::Tensor combine(const torch::Tensor& expert_out, const Dispatch& d, const Routing& routing,
                      Comm& ep);

/// @brief The training loss of one step on this rank: @p ce (the mean cross-entropy of its tokens)
///   plus, for each MoE layer's @p stats (in block order), its auxiliary losses.
///
/// - balance kAux: Switch's load-balancing loss, aux_coef * E * sum_i f_i P_i, where f_i is the
///   fraction of all the global batch's N_g k choices (before any drop) that picked expert i, and
///   P_i the mean over this rank's tokens of expert i's share of the token's scores
///   (RouterStats::shares). f_i counts over every rank of @p data (one collective: it has no
///   gradient); P_i stays local, so that the mean over ranks of the losses, and of their
///   gradients, is the global batch's. At perfect balance the term equals aux_coef.
/// - z_coef > 0: ST-MoE's router z-loss, z_coef * mean over this rank's tokens of
///   logsumexp(logits)^2.
/// Every rank of @p data (all W ranks: each holds its own tokens) calls it.
torch::Tensor moe_loss(const torch::Tensor& ce, const std::vector<RouterStats>& stats,
                       const MoeConfig& config, Comm& data);

/// @brief After backward: every parameter's gradient the single-device gradient of the global
///   batch's mean loss (for an expert shard, its rows of it).
///
/// Each rank's backward left the gradient of its own mean loss: for a replicated parameter, from
/// its tokens; for its experts, from the copies the ep group's ranks sent them (the backward of
/// the all-to-all brought them back). @p params are this rank's (full-model name, parameter);
/// is_expert() tells the two kinds apart. @p data is every rank (W), @p expert_data the ranks
/// that hold the same experts (W / ep).
void reduce_gradients(const std::vector<std::pair<std::string, torch::Tensor>>& params, Comm& data,
                      Comm& expert_data);

/// @brief The auxiliary-loss-free bias step (DeepSeek-V3, Wang et al. 2024), after the optimizer
///   step: expert_bias_i += rate * sign(mean - load_i), where load_i is the number of the global
///   batch's choices that picked expert i this step and mean their average over the E experts.
///
/// @p counts is this rank's (E,) int64 choices per expert (RouterStats::counts); @p bias (E,)
/// float is updated in place, equal on every rank of @p data before and after.
void update_expert_bias(torch::Tensor& bias, const torch::Tensor& counts, double rate, Comm& data);

}  // namespace dtc::l13
