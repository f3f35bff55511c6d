// Lesson 10's given pieces around your attention: the dp x cp x tp mesh and its groups, the
// training loop (so that tests can run it in-process), activation memory (measured and
// predicted), the communication volume of each attention in closed form, and --no-overlap's
// waiting communicator. program.cpp is the program: flags, run, report.
#pragma once

#include <nlohmann/json.hpp>

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "context_parallel.h"
#include "dtc/compat.h"
#include "dtc/dist.h"
#include "dtc/mesh.h"
#include "dtc/observe.h"
#include "sequence_parallel_given.h"

namespace dtc::l10 {

// ---------------------------------------------------------------------------------------------
// The rank grid (given)
// ---------------------------------------------------------------------------------------------

/// @brief The mesh for @p world ranks from --dp, --cp and --tp (0 = not given): tp 1 unless
///   given; then neither dp nor cp -> cp = world / tp, dp 1; one given -> the other is what is
///   left. Dimensions dp_replicate x cp x tp, tp fastest (dtc::Mesh's order): rank = tp_rank +
///   tp (cp_rank + cp dp_rank). A TP group is tp consecutive ranks (one node's NVLink), a CP
///   group strides by tp; the replicas of a weight shard are the dp x cp ranks with the same
///   tp_rank (the group over {"dp_replicate", "cp"}).
/// @throws UsageError (--dp, --cp or --tp) when a degree is below 1 or tp * cp * dp != world.
Mesh make_mesh(int world, int dp, int cp, int tp = 1);

/// This rank's communicators.
struct Groups {
  c10::intrusive_ptr<Comm> tp;        ///< its TP group
  c10::intrusive_ptr<Comm> cp;        ///< its CP group
  c10::intrusive_ptr<Comm> replicas;  ///< the ranks that hold its weights (dp_replicate x cp)
};

/// Builds @p rank's groups over @p store (dtc::MeshGroups: TP, then CP, then the replicas).
Groups make_groups(const c10::intrusive_ptr<c10d::Store>& store, const Mesh& mesh, int rank,
                   BackendKind backend, std::chrono::milliseconds timeout,
                   const std::string& master_addr = "127.0.0.1");

// ---------------------------------------------------------------------------------------------
// Training (given)
// ---------------------------------------------------------------------------------------------

/// Everything that decides a run: lesson 02's RunConfig (its batch is the global batch, split
/// over the dp replicas; each sequence split over the cp ranks), and the attention.
struct CpConfig {
  RunConfig run;
  Attention attention = Attention::kRing;
  bool zigzag = false;
  bool sequence_parallel = false;  ///< Megatron's SP on the TP ranks (with tp > 1)
};

/// @brief Checks @p c against the mesh's degrees before the network is touched: the model
///   splits over tp and cp, the global batch over dp, sequence parallelism has a TP group.
/// @throws UsageError naming the flag (--tp, --cp, --seq, --global-batch, --precision,
///   --sequence-parallel)
void check_config(const CpConfig& c, int dp, int cp, int tp);

/// What train_cp is given besides its configuration and its groups.
struct CpRunOptions {
  int64_t steps = 1;                            ///< optimizer steps
  torch::Device device = torch::kCPU;           ///< where the model and the batches live
  std::function<void(int64_t, float)> on_step;  ///< after every step, with (step, loss)
  bool digest = false;   ///< fill CpRunResult::digest (the fp32 weights AdamW steps)
  bool weights = false;  ///< fill CpRunResult::weights
};

/// What a train_cp run gives back.
struct CpRunResult {
  std::vector<float> losses;  ///< the global batch's loss of every step, on every rank
  /// the parameter digest after the last step (the fp32 weights AdamW steps: the master weights
  /// in bf16), when CpRunOptions::digest
  nlohmann::json digest;
  /// this rank's fp32 weights, in its model's parameters() order (Gpt's with tp 1; the TP
  /// shards, TpGpt's, with tp > 1), when CpRunOptions::weights
  std::vector<torch::Tensor> weights;
};

/// @brief Trains @p config for @p steps: every rank builds the full GPT with init_weights, DP
///   replica d takes rows [d B/dp, (d+1) B/dp) of the global batch, CP rank c its tokens of
///   each row (shard_sequence); without @p tp (or tp 1) the model is CpGpt, with it TpCpGpt
///   (its weights split over tp; the replicated parameters' gradients summed over tp with
///   sequence parallelism); the loss and every gradient are summed over @p replicas (the ranks
///   holding the same weights) and divided by dp, then AdamW steps (dtc::MasterAdamW: fp32
///   master weights in bf16). The update is the baseline's.
/// @param cp this rank's CP group; @p replicas the cp x dp ranks with its tp rank (all ranks
///   with tp 1)
/// @param tp this rank's TP group, or null for tp 1
/// @param options steps, device, a callback per step, and what to give back besides the losses
/// @throws UsageError when dp does not divide the batch, cp the context (validate_cp), tp the
///   model, for fp16, and for bf16 on LibTorch 1.13 (its gloo has no bf16 collectives)
CpRunResult train_cp(const CpConfig& config, Comm& cp, Comm& replicas, Comm* tp,
                     const CpRunOptions& options);

// ---------------------------------------------------------------------------------------------
// Activation memory (given)
// ---------------------------------------------------------------------------------------------

/// @brief The bytes one forward of @p model on @p batch leaves allocated on this thread until
///   backward: what the graph saved (dtc::thread_cpu_memory(), the counting allocator, which
///   must be installed before the model was built). Runs forward and the loss, reads the
///   counter, then backward (so that every rank's collectives match) and clears the gradients.
int64_t measure_activation_bytes(CpGpt& model, const Batch& batch);
/// The same for the tp x cp model.
int64_t measure_activation_bytes(TpCpGpt& model, const Batch& batch);

/// @brief What one layer's forward keeps for backward on one rank, in bytes, for b sequences of
///   s tokens split over cp ranks (n = b s / cp tokens a rank), hidden h, a heads, e bytes an
///   element (4 fp32, 2 bf16), counted tensor by tensor (README section 6). Every kind keeps
///   the residual stream, the LayerNorms' inputs and outputs, the MLP's 4h-wide tensors and the
///   attention's input to c_proj, and the LayerNorms' means and inverse deviations (2 x 2 n e
///   bytes); then:
///   ulysses    q, k and v of a/cp heads over the whole sequence (3 n h), the scores of those
///              heads, e a s^2 b / cp, and the causal mask, s x s bools: e 16 n h + e a s^2 b/cp
///              + s^2;
///   allgather  q (n h), the gathered K and V (2 s b h: every rank holds all of them, because
///              gather_sequence's output stays saved; an all-gather CP that gathers them again
///              in backward, as Transformer Engine's does, keeps only the local k, v), the
///              scores of its n queries over s keys, e a s^2 b / cp, and their mask, s^2 / cp
///              bools: e 14 n h + e 2 s b h + e a s^2 b / cp + s^2 / cp;
///   ring       the qkv projection (3 n h), no scores at all, but the output in fp32 and the
///              log-sum-exp (4 n h + 4 n a): e 16 n h + 4 n h + 4 n a. (fp32 is this
///              implementation's choice: zhuzilin/ring-flash-attention saves the output in q's
///              dtype, e n h, and only the log-sum-exp in fp32.) In fp32 with one head a rank
///              the output needs no reshaping copy for c_proj, which then keeps the same
///              tensor: its 4 n h is counted once (measured in lesson 11).
///   The s^2 terms are those of masked_attention, the course's plain autograd attention; with a
///   FlashAttention-style kernel no kind keeps them (README section 6).
///   With @p tp (the weights split, lesson 08) every tensor of the TP regions and every head's
///   term falls by tp (a/tp heads a rank); the LayerNorm regions (the residual stream, the
///   LayerNorms' inputs and outputs, 4 n h, and their statistics) stay whole on every TP rank,
///   unless @p sequence_parallel splits them too: then every term is divided by tp, as in
///   Korthikanti et al.'s Table 2 row for tensor and sequence parallelism, sbh(34/t + 5as/(ht)).
int64_t predict_layer_activation_bytes(Attention kind, int64_t b, int64_t s, int64_t h, int64_t a,
                                       int cp, int64_t e, int tp = 1,
                                       bool sequence_parallel = false);

/// @brief The whole forward's bytes on one rank: @p layers layers (predict_layer_activation_bytes)
///   and the head: ln_f's input and the output head's input (e n h each), ln_f's statistics
///   (2 n e), the log-softmax of the loss over a @p vocab vocabulary in fp32 (4 n V), and the
///   loss's two fp32 scalars (8).
int64_t predict_activation_bytes(Attention kind, int64_t layers, int64_t b, int64_t s, int64_t h,
                                 int64_t a, int64_t vocab, int cp, int64_t e);

// ---------------------------------------------------------------------------------------------
// Communication volume (given)
// ---------------------------------------------------------------------------------------------

/// What one layer's attention sends per rank and training step, in elements (not counting what
/// a rank keeps of its own), closed forms for b sequences of s tokens, hidden h, over cp ranks.
struct AttentionVolume {
  double forward = 0;        ///< elements each rank sends in the forward
  double backward = 0;       ///< elements each rank sends in the backward, working dtype
  double backward_fp32 = 0;  ///< and in fp32 whatever the dtype (the ring's dK/dV)
  /// The closed form, in words, e.g. "2(cp-1) bsh/cp".
  std::string forward_formula, backward_formula;
};

/// @brief The volume of @p kind: ring, K and V blocks (b s h / cp each) rotate cp - 1 times
///   forward and backward, their gradients cp times; all-gather, K and V gathered forward
///   (cp - 1 blocks each) and their gradients reduce-scattered backward (the same); Ulysses, four
///   all-to-alls (q, k, v and the output) of b (s/cp) h each way, each rank keeping 1/cp of each.
AttentionVolume attention_volume(Attention kind, int64_t b, int64_t s, int64_t h, int cp);

/// --no-overlap: a communicator that completes every receive before returning it (on NCCL, every
/// group of sends and receives), so that the ring's next block has arrived before the current one
/// is computed. The same code, the same messages, no overlap: what the overlap is worth.
class WaitingComm : public ForwardingComm {
  // What a completed receive returns: waiting on it again is a no-op.
  class DoneWork : public c10d::Work {
   public:
    bool isCompleted() override { return true; }
    bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  };

 public:
  explicit WaitingComm(c10::intrusive_ptr<Comm> inner) : ForwardingComm(std::move(inner)) {}
#if TORCH_VERSION_MAJOR >= 2
  void startCoalescing() override {
    grouped_ = true;
    inner_->startCoalescing();
  }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    grouped_ = false;
    auto work = inner_->endCoalescing();
    if (work) work->wait();
    return work;
  }
#endif

 protected:
  c10::intrusive_ptr<c10d::Work> call(
      const char* op, int64_t /*bytes*/, int /*peer*/, int /*tag*/,
      const std::function<c10::intrusive_ptr<c10d::Work>()>& issue) override {
    auto work = issue();
    // in a group (NCCL) the whole group is waited at its end
    if (std::string(op) != "recv" || grouped_) return work;
    work->wait();
    return c10::make_intrusive<DoneWork>();  // a gloo receive must not be waited twice
  }

 private:
  bool grouped_ = false;
};

}  // namespace dtc::l10
