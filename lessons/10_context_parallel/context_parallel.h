// Lesson 10 contract: context parallelism, the sequence split over the ranks of a CP group.
//
// Every layer of the course's GPT but attention works token by token: split the tokens of each
// sequence over cp ranks and the embeddings, LayerNorms and MLPs need no communication at all.
// Attention mixes tokens, so each rank's queries must meet every rank's keys and values. Three
// ways to make them meet, each an exercise here:
//   ring attention   K/V blocks rotate around the CP ring, one step per rank, each step's send
//                    overlapped with the current block's attention, the partial results merged
//                    with the online softmax (log-sum-exp); backward by hand, dK/dV riding along
//                    (Liu et al. 2023, arXiv:2310.01889).
//   Ulysses          all-to-all from sequence-sharded to head-sharded, full-sequence attention
//                    on heads/cp heads, all-to-all back (Jacobs et al. 2023, arXiv:2309.14509).
//   all-gather KV    every rank gathers the whole K and V and keeps its own queries (Llama 3,
//                    Dubey et al. 2024, arXiv:2407.21783, sec. 3.3.2); here the gathered K and V
//                    stay saved for backward (Transformer Engine's all-gather CP saves the local
//                    k, v and gathers them again in backward instead).
// With a causal mask, contiguous chunks leave rank 0 almost idle and the last rank with all the
// work; the zig-zag split (rank r holds chunks r and 2cp-1-r of 2cp: Llama 3 sec. 3.3.2 for its
// all-gather CP; the ring's plan is zhuzilin/ring-flash-attention's zigzag_ring_flash_attn and
// Transformer Engine's AttnFuncWithCPAndKVP2P) balances the ring.
// This header is the whole specification of what you implement in context_parallel.cpp;
// README.md beside it teaches it. Build and test:
//
//   make test-lesson10          # your exercise, test by test
//   make run-lesson10           # the program on 2 ranks: build/bin/lesson10 --help
//
// Shapes: B batch, H heads, T the whole sequence, Tl = T / cp this rank's tokens, D head size.
// Every function that takes a communicator is collective: every rank of @p cp calls it, in the
// same order, with tensors of the same shapes.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dtc/compat.h"
#include "dtc/data.h"
#include "dtc/dist.h"
#include "dtc/model.h"

namespace dtc::l10 {

// ---------------------------------------------------------------------------------------------
// Given: splitting the sequence, and the attention of one block
// ---------------------------------------------------------------------------------------------

/// How the ranks' queries meet the other ranks' keys and values.
enum class Attention { kRing, kUlysses, kAllGather };

/// "ring", "ulysses" or "allgather".
const char* attention_name(Attention kind);

/// Checks that @p cp ranks can split a sequence of @p seq tokens of a model of @p heads heads
/// with @p kind: cp divides seq (2 cp with @p zigzag: each rank holds two chunks), and, for
/// Ulysses, cp divides heads (each rank attends with whole heads). The zig-zag split applies to
/// ring and all-gather (Ulysses gathers the whole sequence: it needs no balancing); only the
/// ring's work changes with it: allgather_attention computes every rank's dense Tl x T scores
/// whatever the split (a kernel that skips masked keys would be balanced by it).
/// @throws UsageError naming --seq, --heads, --cp or --zigzag, with the values that would fit.
void validate_cp(int64_t seq, int64_t heads, int cp, Attention kind, bool zigzag);

/// The global positions, in order, of the tokens rank @p rank of @p cp holds of a sequence of
/// @p seq: contiguous, [r seq/cp, (r+1) seq/cp); zig-zag, chunks r and 2cp-1-r of 2cp chunks
/// of seq/(2cp) each (rank 0 of 2: chunks 0 and 3, rank 1: chunks 1 and 2). int64 (seq / cp).
torch::Tensor local_positions(int64_t seq, int rank, int cp, bool zigzag);

/// The tokens of @p x along @p dim that rank @p rank holds (local_positions), as a new tensor.
torch::Tensor shard_sequence(const torch::Tensor& x, int rank, int cp, bool zigzag,
                             int64_t dim = 1);

/// @brief Masked attention, differentiable: softmax(q k^T / sqrt(D) + mask) v.
///
/// q (B, H, Tq, D), k and v (B, H, Tk, D); q_pos (Tq) and k_pos (Tk) the tokens' global
/// positions. With @p causal, query i sees key j only when k_pos[j] <= q_pos[i]. With q_pos =
/// k_pos = 0..T-1 it is the course's attention core (dtc::CausalSelfAttentionImpl::core,
/// before its heads are concatenated). Every query must see at least one key.
/// @return (B, H, Tq, D)
torch::Tensor masked_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& q_pos,
                               const torch::Tensor& k_pos, bool causal);

/// One block's attention without normalising across blocks: what a ring step computes.
struct BlockOut {
  torch::Tensor out;  ///< (B, H, Tq, D): softmax over this block's keys only, times v
  torch::Tensor lse;  ///< (B, H, Tq) float32: log sum_j exp(score_ij) over this block's keys
};

/// @brief The attention of queries @p q to one block of keys @p k, values @p v (no autograd:
///   ring attention writes its own backward).
///
/// Masking as masked_attention. A query that sees no key of the block gets out 0 and lse -inf
/// (it is then a no-op for merge_block). Every call is reported to the block observer first.
BlockOut block_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& q_pos, const torch::Tensor& k_pos, bool causal);

/// The gradients one block contributes.
struct BlockGrads {
  torch::Tensor dq;  ///< (B, H, Tq, D)
  torch::Tensor dk;  ///< (B, H, Tk, D)
  torch::Tensor dv;  ///< (B, H, Tk, D)
};

/// @brief The gradients of one block of attention, from the MERGED forward's @p out and @p lse
///   (over all blocks) and the output's gradient @p dout (FlashAttention's backward: Dao et al.
///   2022, Alg. 4, from the row maxima and sums; in this log-sum-exp form FlashAttention-2, Dao
///   2023, arXiv:2307.08691, Alg. 2): with P = exp(S - lse) this block's probabilities within the
///   whole softmax, dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)),
///   dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D). The blocks' contributions add up to the unsplit
///   gradients. Given; reported to the block observer like block_attention.
BlockGrads block_attention_backward(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& q_pos,
                                    const torch::Tensor& k_pos, bool causal,
                                    const torch::Tensor& out, const torch::Tensor& lse,
                                    const torch::Tensor& dout);

/// Called with (query rows, key rows, backward?) at the start of every block_attention and
/// block_attention_backward call on this thread: what tests use to see the work each rank does
/// (Tq x Tk scores a block) and when, from outside your code.
using BlockObserver = std::function<void(int64_t q_rows, int64_t k_rows, bool backward)>;
/// Sets this thread's observer (an empty function: none). Returns the previous one.
BlockObserver set_block_observer(BlockObserver observer);

/// @brief One all-to-all of @p x's first dimension in equal slices (alltoall_base), waited
///   for: slice j goes to rank j, and slice j of the result came from rank j. Given.
torch::Tensor all_to_all(const torch::Tensor& x, Comm& comm);

/// One K/V exchange around the ring, in flight: started by start_rotation, waited by finish.
struct Rotation {
  std::vector<torch::Tensor> received;               ///< filled once finish() returns
  std::vector<c10::intrusive_ptr<c10d::Work>> work;  ///< the sends and receives in flight
  /// Waits for every send and receive; then received holds the previous rank's tensors.
  std::vector<torch::Tensor> finish();
};

/// @brief Sends each of @p tensors to the next rank of the ring, (r + 1) % cp, and receives the
///   previous rank's into new tensors of the same shapes, all at once (dtc::batch_isend_irecv),
///   without waiting. Given. On a ring of one rank, a copy of @p tensors comes back.
/// @param tag tensor i travels with tag tag + i: two rotations in flight at once (K/V and their
///   gradients) must use tags that do not overlap
Rotation start_rotation(const std::vector<torch::Tensor>& tensors, Comm& cp, int tag = 0);

// ---------------------------------------------------------------------------------------------
// What you implement, part 1: the online-softmax merge
// ---------------------------------------------------------------------------------------------

/// @brief Folds one block's result into the running result, in place: afterwards (out, lse) are
///   the attention over the keys of every block merged so far, as if computed in one softmax.
///
/// What must hold (L10Merge.*): merging blocks in any order gives the attention over all their
/// keys, to fp32 rounding; a row whose block lse is -inf is left as it was; a row whose running
/// lse is -inf takes the block's values; scores in the thousands (exp overflows fp32) stay
/// finite. README section 2 derives the update.
/// @param out (B, H, Tq, D), the running output; may be a view (e.g. some rows of a larger one)
/// @param lse (B, H, Tq) float32, the running log-sum-exp, -inf where no key was seen yet
void merge_block(torch::Tensor& out, torch::Tensor& lse, const BlockOut& block);

// ---------------------------------------------------------------------------------------------
// What you implement, part 2: ring attention
// ---------------------------------------------------------------------------------------------

/// The work of one ring step: which of this rank's query rows meet which rows of the visiting
/// K/V block (ranges of local rows), and whether the causal mask is needed inside it.
struct RingBlock {
  bool skip = false;    ///< nothing to compute: every key of the block is in every query's future
  int64_t q_begin = 0;  ///< first query row (local)
  int64_t q_len = 0;    ///< query rows
  int64_t k_begin = 0;  ///< first key row of the visiting block (its own local numbering)
  int64_t k_len = 0;    ///< key rows
  bool masked = false;  ///< true when some query of the range must not see some key of it
};

/// @brief The part of the block from rank @p src that rank @p rank must compute (cp ranks,
///   @p local_len tokens each, split contiguously or zig-zag).
///
/// What must hold (L10Ring.BlockPlan*): the scores it selects are exactly those the causal mask
/// lets through (every pair (query, key) with k_pos <= q_pos lies inside the range, and no range
/// that is wholly in the future is computed: skip); without @p causal, the whole block. With
/// @p zigzag every rank does the same work (the same q_len x k_len summed over its steps);
/// contiguous, rank r computes r + 1 blocks' worth. README section 3 draws the cases.
RingBlock ring_block(int rank, int src, int cp, int64_t local_len, bool zigzag, bool causal);

/// @brief Ring attention: each rank's queries against every rank's keys, K/V rotating around
///   the ring of @p cp, differentiable through a backward written by hand.
///
/// q, k, v (B, H, Tl, D): this rank's tokens (local_positions(cp * Tl, rank, cp, zigzag)).
/// Forward: cp steps; at step s this rank holds the K/V block of rank (rank - s) mod cp,
/// computes ring_block's part of it with block_attention and merges it (merge_block); the next
/// block's exchange (start_rotation) is started BEFORE the current block is computed and
/// waited after, so that communication and compute overlap. Saves q, k, v, out and lse for
/// backward, nothing of size Tl x Tl.
/// Backward: the same cp steps; the K/V blocks rotate again (cp - 1 times), and so does each
/// block's dK/dV accumulator, to which every rank adds its block_attention_backward
/// contribution: one hop per step, cp hops in all, so that the hop started at the last step
/// brings each accumulator home.
/// What must hold (L10Ring.*): the values and gradients of masked_attention on the whole
/// sequence (the rows of this rank), for cp 2, 3 and 4, contiguous and zig-zag, causal or not;
/// each step's exchange in flight while its block is computed.
/// @return (B, H, Tl, D), this rank's rows of the output
torch::Tensor ring_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             Comm& cp, bool zigzag, bool causal = true);

// ---------------------------------------------------------------------------------------------
// What you implement, part 3: Ulysses (all-to-all) attention
// ---------------------------------------------------------------------------------------------

/// @brief Sequence-sharded to head-sharded, with one all-to-all: x (B, H, Tl, D), this rank's
///   tokens of every head -> (B, H/cp, cp * Tl, D), every rank's tokens (rank j's at rows
///   [j Tl, (j+1) Tl)) of heads [r H/cp, (r+1) H/cp). Differentiable: its backward is
///   heads_to_seq.
/// What must hold (L10Ulysses.*): the layout above, and heads_to_seq(seq_to_heads(x)) == x,
/// bit for bit; one alltoall per call. README section 4 hints.
/// @throws std::invalid_argument when cp does not divide H
torch::Tensor seq_to_heads(const torch::Tensor& x, Comm& cp);

/// @brief The inverse of seq_to_heads: (B, H/cp, cp * Tl, D) -> (B, H, Tl, D). Its backward is
///   seq_to_heads.
torch::Tensor heads_to_seq(const torch::Tensor& x, Comm& cp);

/// @brief DeepSpeed-Ulysses attention: seq_to_heads on q, k and v, masked_attention of the
///   whole sequence on this rank's heads, heads_to_seq back. Given.
torch::Tensor ulysses_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, Comm& cp, bool zigzag, bool causal = true);

// ---------------------------------------------------------------------------------------------
// What you implement, part 4: all-gather KV attention
// ---------------------------------------------------------------------------------------------

/// @brief Every rank's x along the sequence: x (B, H, Tl, D) -> (B, H, cp * Tl, D), rank j's
///   rows at [j Tl, (j+1) Tl). Differentiable: backward reduce-scatters, each rank receiving the
///   sum over the ranks of the gradient of its own rows.
/// What must hold (L10AllGather.*): the layout; the gradient summed over the ranks, exactly; one
/// allgather forward, one alltoall backward (the same on both LibTorch generations: 1.13's gloo
/// has no reduce_scatter).
torch::Tensor gather_sequence(const torch::Tensor& x, Comm& cp);

/// @brief Llama 3's context parallelism: gather_sequence on k and v (the whole sequence's keys
///   and values on every rank), masked_attention of this rank's queries against them. Given.
///   The gathered K and V stay saved until backward (README section 6).
torch::Tensor allgather_attention(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, Comm& cp, bool zigzag,
                                  bool causal = true);

/// The attention of @p kind (given): ring_attention, ulysses_attention or allgather_attention.
torch::Tensor context_attention(Attention kind, const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, Comm& cp, bool zigzag, bool causal = true);

// ---------------------------------------------------------------------------------------------
// The context-parallel GPT (given)
// ---------------------------------------------------------------------------------------------

/// The course's GPT on this rank's tokens of each sequence: the full model's weights, replicated
/// on every CP rank; wte, wpe (at the tokens' global positions), LayerNorms, MLPs and the head
/// token by token; attention through context_attention. It is dtc::Gpt itself with two parts
/// swapped (Gpt::set_positions, Gpt::set_attention_core): no block loop of its own.
class CpGptImpl : public torch::nn::Module {
 public:
  /// @brief Wraps @p full (its weights, not a copy: train it through this module), and sets
  ///   @p full's positions and attention core (they stay set on it).
  /// @throws UsageError (validate_cp) when cp cannot split the model's context this way
  CpGptImpl(const Gpt& full, Comm& cp, Attention kind, bool zigzag);
  /// tokens (B, Tl), this rank's tokens of each sequence -> logits (B, Tl, V), float32
  torch::Tensor forward(const torch::Tensor& tokens);
  /// @brief This rank's share of the batch's mean next-token cross-entropy: the sum over its
  ///   tokens divided by ALL the tokens (B x T). Summed over the CP group (and its gradients
  ///   too) it is the unsplit model's loss. @p batch holds this rank's tokens (shard_sequence).
  torch::Tensor loss(const Batch& batch);

  Gpt gpt;                  ///< the replicated weights
  Comm* cp;                 ///< the CP group (not owned)
  Attention kind;           ///< how attention meets the other ranks' tokens
  bool zigzag = false;      ///< the split of the sequence
  torch::Tensor positions;  ///< this rank's tokens' global positions (Tl)
};
TORCH_MODULE(CpGpt);

}  // namespace dtc::l10
