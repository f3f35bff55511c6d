// Lesson 07 contract: ZeRO stages 1-3 (and stage 0, plain data parallelism, as the reference).
//
// Every data-parallel rank trains the same GPT on its rows of the global batch. Stage 0 (DDP)
// keeps everything on every rank; ZeRO (Rajbhandari et al. 2020) shards, across the W ranks,
//   stage 1: the optimizer state (AdamW's two moments),
//   stage 2: ... and the gradients,
//   stage 3: ... and the parameters, gathered one unit (a transformer block) at a time.
// This header is the whole specification of what you implement in zero.cpp; README.md beside
// it teaches it. Build and test:
//
//   make test-lesson07          # your exercise, test by test
//   make run-lesson07 ARGS="--stage 2"
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtc/compat.h"
#include "dtc/data.h"
#include "dtc/model.h"
#include "dtc/storage.h"

namespace dtc::l07 {

// ---------------------------------------------------------------------------------------------
// The flat, padded layout (FSDP's "flat parameter", one per unit)
// ---------------------------------------------------------------------------------------------

/// One unit: the parameters that are gathered together (the embeddings and the output head, or
/// one transformer block), flattened into one range of the flat buffer and padded with zeros
/// to a multiple of W, so that each rank owns an equal chunk of it.
struct Unit {
  std::string name;                          ///< "outer" (wte, wpe, ln_f, lm_head) or `h.<i>`
  std::vector<torch::Tensor> params;         ///< the model's parameters, in order
  std::vector<std::string> names;            ///< their names (named_parameters())
  std::vector<std::vector<int64_t>> shapes;  ///< their shapes (stage 3 empties the tensors)
  int64_t numel = 0;                         ///< sum of their numel(): no padding
  int64_t padded = 0;                        ///< numel rounded up to a multiple of W
  int64_t offset = 0;                        ///< where the unit starts in the full flat buffer
  int64_t shard_offset = 0;                  ///< where this rank's chunk starts in its shard buffer
  int world = 1;                             ///< W
  bool bound = false;  ///< the parameters view a buffer bind_unit gave them (release_unit clears)
  int64_t chunk() const { return padded / world; }  ///< elements per rank: padded / W
};

/// All units of a model. The full flat buffer is unit 0 (padded), unit 1 (padded), ...; rank r's
/// shard buffer is its chunk of unit 0, its chunk of unit 1, ...
struct FlatLayout {
  std::vector<Unit> units;  ///< units[0] is "outer", units[1 + i] is block `h.<i>`
  int world = 1;            ///< W
  int64_t numel = 0;        ///< Psi: parameters of the model, tied weights counted once
  int64_t padded = 0;       ///< sum of the units' padded sizes: the full flat buffer
  int64_t shard = 0;        ///< padded / W: one rank's shard buffer
};

/// @p numel rounded up to a multiple of @p world (0 stays 0).
/// @throws std::invalid_argument for world < 1 or numel < 0.
int64_t padded_size(int64_t numel, int world);

/// Groups @p model's parameters into units ("outer": wte, wpe, ln_f and lm_head when untied;
/// then one unit per block) and lays them out for @p world ranks with padded_size().
/// Given in full. A tied output head is wte itself: parameters() lists it once, so it is
/// stored once.
FlatLayout make_layout(Gpt& model, int world);

// ---------------------------------------------------------------------------------------------
// Collectives that count their bytes
// ---------------------------------------------------------------------------------------------

/// A collective that has been started and not yet finished (for overlap and prefetch).
struct Pending {
  c10::intrusive_ptr<c10d::Work> work;  ///< wait() on it before reading the result
  torch::Tensor buffer;                 ///< what the collective writes into
  int64_t chunk = 0;                    ///< elements per rank
  torch::Tensor input;  ///< what it reads, where the caller frees it once done (may be undefined)
};

/// Reduce-scatter, all-gather and allreduce on the flat buffers, over any gloo (1.13 or 2.x),
/// each adding to bytes_sent() what one rank sends in the ring algorithm (lesson 03):
/// (W-1)/W * N * e bytes for a reduce-scatter or an all-gather of N elements of e bytes each
/// (element_size(): 4 in fp32, 2 in bf16), and twice that for an allreduce. The collectives run
/// in the dtype of the tensors they are given.
class CountingComm {
 public:
  explicit CountingComm(c10::intrusive_ptr<Comm> comm) : comm_(std::move(comm)) {}
  int rank() const { return comm_->getRank(); }
  int world() const { return comm_->getSize(); }
  Comm& comm() { return *comm_; }

  /// Starts a reduce-scatter of @p flat (W * chunk elements, contiguous) with alltoall_base
  /// (1.13's gloo has no reduce_scatter): once finished, rank r holds the sum over ranks of
  /// chunk r. Counts (W-1)/W * numel * element_size() bytes.
  Pending reduce_scatter_start(const torch::Tensor& flat);
  /// Waits for @p pending and returns the sum over ranks of chunk r: (chunk).
  static torch::Tensor reduce_scatter_finish(Pending& pending);
  /// reduce_scatter_start, then reduce_scatter_finish.
  torch::Tensor reduce_scatter(const torch::Tensor& flat);

  /// Starts an all-gather of @p chunk (every rank's chunk has the same size): once finished,
  /// Pending::buffer (W * chunk) holds rank j's chunk as its chunk j. Counts (W-1)/W * buffer
  /// numel * element_size() bytes.
  Pending all_gather_start(const torch::Tensor& chunk);
  /// Waits for @p pending and returns its buffer.
  static torch::Tensor all_gather_finish(Pending& pending);
  /// all_gather_start, then all_gather_finish.
  torch::Tensor all_gather(const torch::Tensor& chunk);

  /// Sums @p flat over ranks in place (allreduce). Counts 2 (W-1)/W * numel * element_size()
  /// bytes.
  void all_reduce(torch::Tensor& flat);

  /// Bytes this rank has sent since construction or reset_bytes(), by the ring's count.
  int64_t bytes_sent() const { return bytes_; }
  void reset_bytes() { bytes_ = 0; }

 private:
  c10::intrusive_ptr<Comm> comm_;
  int64_t bytes_ = 0;
};

// ---------------------------------------------------------------------------------------------
// AdamW, elementwise
// ---------------------------------------------------------------------------------------------

/// AdamW's hyperparameters (PyTorch's defaults, lesson 02's learning rate).
struct AdamWOptions {
  double lr = 3e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

/// One AdamW update, in place, of @p param from @p grad, with moments @p exp_avg and
/// @p exp_avg_sq (same shape), at step @p step (1 on the first update), exactly as
/// torch::optim::AdamW does it:
///   param *= 1 - lr * weight_decay
///   exp_avg = beta1 exp_avg + (1 - beta1) grad
///   exp_avg_sq = beta2 exp_avg_sq + (1 - beta2) grad^2
///   denom = sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps
///   param -= lr / (1 - beta1^step) * exp_avg / denom
/// Every line is elementwise: updating a shard equals updating the full tensor, shard by shard.
/// That is why ZeRO can shard the optimizer state at no cost in accuracy.
void adamw_update(torch::Tensor param, const torch::Tensor& grad, torch::Tensor exp_avg,
                  torch::Tensor exp_avg_sq, int64_t step, const AdamWOptions& options);

// Freeing a tensor's memory behind autograd (what FSDP does): dtc/storage.h's free_storage() and
// refill_storage(), given.
using ::dtc::free_storage;
using ::dtc::refill_storage;

// ---------------------------------------------------------------------------------------------
// The engine
// ---------------------------------------------------------------------------------------------

/// Options of a ZeRO run.
struct ZeroOptions {
  int stage = 0;          ///< 0 (DDP), 1, 2 or 3
  bool prefetch = false;  ///< stage 3: start gathering the next unit before computing this one
  /// Stage 3: keep only each block's input and recompute the block in backward (activation
  /// checkpointing), instead of keeping its activations and freeing only its parameters.
  bool recompute = false;
  /// Stage 3: free a block's gathered parameters after its forward and gather them again for
  /// its backward (FSDP's reshard_after_forward=True: 3 Psi a step). false keeps them from the
  /// block's forward to its backward: one gather per block, 2 Psi a step, and every block's
  /// parameters in memory at the end of forward (FSDP2's reshard_after_forward=False, FSDP1's
  /// SHARD_GRAD_OP: ZeRO-2's traffic, with parameters sharded between steps).
  bool reshard_after_forward = true;
  /// > 0: before AdamW, scale the gradient so that its global 2-norm is at most this
  /// (torch::nn::utils::clip_grad_norm_ on the unsharded gradient), from the shards.
  double clip_norm = 0;
  AdamWOptions adamw;
  /// Mixed precision (ZeRO's own layout, the paper's 2 + 2 + 12 bytes per parameter): kBf16
  /// keeps the parameters and gradients in bf16 (what forward, backward and the all-gathers
  /// use) and, beside AdamW's fp32 moments, an fp32 master copy of the weights with the
  /// moments' layout (stage 0 whole, stages 1-3 this rank's shard), which AdamW updates and
  /// which is rounded into the bf16 parameters after each step. kFp16 is refused (it needs
  /// lesson 02's loss scaler).
  Precision precision = Precision::kFp32;
  /// The dtype the gradients are reduced and kept in (the wire dtype of FSDP's
  /// MixedPrecisionPolicy reduce_dtype; Megatron's grad_reduce_in_fp32). Unset: the working
  /// dtype (FSDP's reduce_dtype=None, DDP over a bf16 model's buckets). Stages 2-3 cast each
  /// unit's working-dtype gradient to it before the reduce-scatter and keep the shard's gradient
  /// in it. Stages 0-1 keep the whole gradient buffer in it: wider than the parameters (bf16
  /// parameters, fp32 here), a hook moves each parameter's gradient into the fp32 buffer as
  /// autograd writes it (Megatron's main_grad), so that stage 1 in bf16 with an fp32 reduce is
  /// Megatron's distributed optimizer: 2 + 4 + 12 / W bytes per parameter.
  std::optional<Precision> reduce;
};

/// One rank of a data-parallel run of the course's GPT at a ZeRO stage.
///
/// It takes over @p model's parameters: stages 0-2 keep a full flat buffer (the parameters
/// become views of it), stage 3 keeps only this rank's shard (the parameters are empty between
/// uses). Training: forward_backward() on this rank's rows, then optimizer_step().
class ZeroEngine {
 public:
  /// @p replicate: HSDP (FSDP's HYBRID_SHARD, PyTorch's 2-D device mesh (replicate, shard)).
  /// @p comm is then this rank's shard group, G ranks (usually one node), which the layout
  /// shards over and whose collectives are the stage's; @p replicate is the group of the W/G
  /// ranks that hold the same shard. After each unit's reduce-scatter (the G-rank mean), an
  /// allreduce over @p replicate averages the shard over the replicas (given code): 2 (R-1)/R
  /// of the shard's bytes each, R = W/G, on the slower inter-node links, instead of sharding
  /// over all W. Stages 2 and 3 (ZeRO-2-like FSDP, _HYBRID_SHARD_ZERO2, and HYBRID_SHARD).
  /// @throws UsageError("--stage") for a stage outside 0..3, UsageError("--hsdp") for HSDP at
  ///   stage 0 or 1.
  ZeroEngine(Gpt model, c10::intrusive_ptr<Comm> comm, const ZeroOptions& options,
             c10::intrusive_ptr<Comm> replicate = {});

  /// Forward and backward on @p batch (this rank's rows), then the stage's gradient
  /// communication, so that this rank holds the gradient it needs, averaged over the W ranks:
  ///   stage 0: the full flat gradient, allreduced;
  ///   stage 1: the full flat gradient buffer, its chunk r reduce-scattered;
  ///   stages 2, 3: only the shard's gradient (grad_shard_), reduce-scattered unit by unit
  ///   during backward; the full gradients of a unit are freed right after.
  /// Stage 3 gathers each block's parameters before its forward and again before its backward.
  /// By default it keeps the block's activations, as stage 2 does, and between the two frees
  /// only the gathered parameters, with free_storage(), refilling that same storage from the
  /// second gather with refill_storage() (FSDP's reshard after forward). With
  /// ZeroOptions::recompute it keeps only the block's input, and recomputes the block in
  /// backward.
  /// @return this rank's loss (mean over its rows), before the update.
  float forward_backward(const Batch& batch);

  /// AdamW on what this rank owns (stage 0: everything; stages 1-3: its shard), then, for
  /// stages 1 and 2, the all-gather that gives every rank the updated full parameters. With
  /// ZeroOptions::clip_norm > 0, clip_gradients() first.
  void optimizer_step();

  /// Gradient clipping by the global norm, on what this rank owns: the norm is not elementwise,
  /// so each rank sums the squares of its own part (stage 0: the whole gradient; stage 1: its
  /// chunk of each unit; stages 2-3: its shard), one allreduce adds them up (stages 1-3), and
  /// every rank scales its part by min(1, max_norm / (norm + 1e-6)), PyTorch's clip_coef.
  /// Collective for stages 1-3. @return the gradient's global norm before clipping.
  double clip_gradients(double max_norm);
  /// The global norm that the last optimizer_step() clipped (0 without clipping).
  double last_grad_norm() const { return last_grad_norm_; }

  /// The full weights in fp32, flat and unpadded (Psi elements, units in order, each unit's
  /// parameters in order): a copy of the parameters, gathered for stage 3; in bf16 the fp32
  /// master weights (gathered at stages 1-3), of which the parameters are the rounding.
  /// Collective: every rank must call it.
  torch::Tensor full_parameters();

  /// What this rank owns, in the shard layout (layout().shard elements each; copies): its chunk
  /// of the parameters and of both moments (zeros before the first step), and the step count.
  /// In bf16 the parameters are the fp32 master weights (what training resumes from), so that a
  /// checkpoint holds fp32 state whatever the precision, and loads into either.
  struct ShardState {
    torch::Tensor params, exp_avg, exp_avg_sq;
    int64_t step = 0;
  };
  ShardState shard_state();

  /// Replaces the training state with what this rank keeps, after @p step steps. @p params is
  /// full and unpadded (Psi elements, as full_parameters() lays them out) where the stage
  /// replicates the parameters (0-2), else this rank's shard (layout().shard elements, as
  /// shard_state() lays it out); @p exp_avg and @p exp_avg_sq are full and unpadded at stage 0,
  /// else the shard. In bf16 @p params are the fp32 master weights, and the parameters become
  /// their rounding. Not collective (checkpoint loading). Given.
  /// @throws std::invalid_argument when a tensor has another number of elements.
  void load_owned_state(const torch::Tensor& params, const torch::Tensor& exp_avg,
                        const torch::Tensor& exp_avg_sq, int64_t step);

  int64_t steps_done() const { return step_; }
  const FlatLayout& layout() const { return layout_; }
  CountingComm& comm() { return comm_; }
  /// HSDP's replicate group (its bytes counted as comm()'s are), or nullptr without HSDP.
  CountingComm* replicate_comm() { return replicate_.get(); }
  int stage() const { return options_.stage; }
  Precision precision() const { return options_.precision; }
  /// bf16: the fp32 master weights this rank keeps (padded, stage 0; the shard, stages 1-3);
  /// undefined in fp32, where the parameters are their own master.
  const torch::Tensor& master() const { return master_; }
  Gpt& model() { return model_; }

 private:
  // The pieces of forward_backward, by stage.
  float forward_backward_replicated(const Batch& batch);  // stages 0 and 1
  float forward_backward_sharded(const Batch& batch);     // stages 2 and 3
  // Stage 3: make unit u's parameters usable (views of a gathered buffer) / empty again. Given.
  // release_unit frees the gathered buffer's memory itself (free_storage, as FSDP2 does), not
  // only the parameters' references to it: the finished all-gather's Work also references it,
  // and gloo's worker thread drops that reference a moment after wait() has returned, so that
  // dropping ours alone would free the memory at a time that depends on that thread.
  void bind_unit(Unit& unit, const torch::Tensor& full);
  void release_unit(Unit& unit);
  // This rank's chunk of unit u in a full flat buffer / in the shard buffer (undefined for an
  // undefined shard: fp32's master()).
  torch::Tensor chunk_of_full(const torch::Tensor& full, const Unit& unit) const;
  torch::Tensor chunk_of_shard(const torch::Tensor& shard, const Unit& unit) const;
  // A zeroed gradient buffer for @p unit (padded), in the parameters' dtype, which autograd
  // requires of a gradient. Given.
  torch::Tensor grad_buffer(const Unit& unit) const;
  // Starts the reduce-scatter of a unit's padded gradient buffer in the reduce dtype (a cast
  // copy when the buffer's dtype differs: bf16 gradients, fp32 reduce_dtype). Given.
  Pending reduce_start(const torch::Tensor& grads);
  // Finishes it, stores the average in the shard's gradient, and frees the collective's input
  // and receive buffer (free_storage: for the reason release_unit gives). Given.
  void reduce_unit_gradient(Pending& pending, const Unit& unit);
  // AdamW's update of what this rank owns (flat, same numel), given: adamw_update() on
  // @p params from @p grad in fp32; in bf16 on @p master (same layout as the moments) from
  // @p grad cast to fp32, then @p params = @p master rounded to bf16. @p master is undefined in
  // fp32. In pieces of 2^18 elements (exact: AdamW is elementwise), so that the step's
  // temporaries stay small.
  void update(torch::Tensor params, const torch::Tensor& grad, torch::Tensor exp_avg,
              torch::Tensor exp_avg_sq, const torch::Tensor& master);
  // The full flat (padded) fp32 buffer from this rank's shard of it (an all-gather per unit,
  // not counted: inspection, not training).
  torch::Tensor gather_shards(const torch::Tensor& shard);
  // Makes AdamW's moments (zeros) on the first step: stage 0 full, stages 1-3 a shard.
  void ensure_moments();
  // This rank's chunks of a full (padded) flat buffer, concatenated: the shard layout.
  torch::Tensor shard_of_full(const torch::Tensor& full) const;
  // The full flat buffer (padded) from a Psi-element unpadded one, and back.
  torch::Tensor pad_full(const torch::Tensor& unpadded) const;
  torch::Tensor unpad_full(const torch::Tensor& padded) const;

  Gpt model_;
  torch::TensorOptions float_options_;   ///< fp32 on the model's device
  torch::TensorOptions param_options_;   ///< the working dtype (parameters, their gradients)
  torch::TensorOptions reduce_options_;  ///< the reduce dtype (the reduced gradient's)
  CountingComm comm_;
  std::unique_ptr<CountingComm> replicate_;  ///< HSDP: the ranks holding the same shard
  ZeroOptions options_;
  FlatLayout layout_;
  torch::Tensor flat_params_;  ///< stages 0-2: (padded); stage 3: undefined
  torch::Tensor
      flat_grads_;  ///< stages 0-1: (padded), the reduce dtype, made by the first backward
  /// Stages 0-1 reducing in a wider dtype than the parameters': the accumulators whose hooks
  /// move each gradient into flat_grads_ (held: a parameter keeps its own only weakly).
  std::vector<GradAccumulator> main_grad_hooks_;
  torch::Tensor param_shard_;  ///< stage 3: (shard), the only copy of the parameters
  torch::Tensor grad_shard_;   ///< stages 2-3: (shard), made by the first backward
  torch::Tensor exp_avg_;      ///< stage 0: (padded); stages 1-3: (shard); after step 1
  torch::Tensor exp_avg_sq_;   ///< same
  torch::Tensor master_;       ///< bf16: fp32 master weights, the moments' layout (made at once)
  int64_t step_ = 0;
  double last_grad_norm_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Sharded checkpoints
// ---------------------------------------------------------------------------------------------

/// Writes this rank's shard (parameters, both moments, step, and the layout's unit sizes and
/// W) to @p dir/shard-<r>-of-<W>.pt, atomically (a .tmp file, then rename), then, once every
/// rank's file is in place, rank 0 writes @p dir/COMPLETE (with W), atomically too: a save that
/// dies halfway leaves no COMPLETE, and load_sharded() refuses it. Collective: every rank calls
/// it; @p dir must exist.
/// In bf16 the parameters saved are the fp32 master weights (shard_state()).
/// @throws UsageError("--save-sharded") for an HSDP engine (its replicas would write one file).
void save_sharded(ZeroEngine& engine, const std::string& dir);

/// Elements [@p begin, @p end) of unit @p unit's unpadded range (0 <= begin <= end <=
/// layout.units[unit].numel), from a checkpoint saved by @p saved_world ranks. Saved file j
/// holds, for every unit in order, chunk j of the unit in the layout of those N ranks:
/// padded_size(numel, N) / N elements (zeros past numel), starting where the earlier units'
/// N-rank chunks end. @p shard_of(j) returns file j's flat tensor (the parameters, or one
/// moment); read_unit_range() asks it only for the files whose chunk of the unit overlaps
/// [begin, end), none for an empty range: loading, a rank reads only the files that hold what
/// it keeps (as torch.distributed.checkpoint plans its reads).
/// @throws std::invalid_argument for a unit, range or saved_world out of bounds.
torch::Tensor read_unit_range(const FlatLayout& layout, size_t unit, int64_t begin, int64_t end,
                              int saved_world,
                              const std::function<torch::Tensor(int file)>& shard_of);

/// Loads a checkpoint saved by save_sharded() with any number N of ranks into @p engine, which
/// may run on M != N ranks and at any stage (re-sharding). For each unit, this rank keeps the
/// whole unit where its stage replicates it (the parameters at stages 0-2, the moments at stage
/// 0), else its chunk of the M-rank layout; read_unit_range() gets exactly that range from the
/// files, each file read once, when first needed, and none that holds nothing this rank keeps
/// (at stage 3 on M >= N ranks, one or two of the N files instead of N), and
/// load_owned_state() takes it. Collective: one allreduce agrees on the outcome, so that a bad
/// file that only some ranks read stops every rank. Given.
/// @throws UsageError("--load-sharded") when @p dir is not a directory, has no COMPLETE marker
///   (the save did not finish), lacks a file, holds another model, or another rank failed; also
///   for an HSDP engine (these checkpoints are plain ZeRO's).
void load_sharded(ZeroEngine& engine, const std::string& dir);

/// Gathers the full parameters and writes them on rank 0 to @p file as one archive of named
/// tensors (named_parameters() names, the unsharded model). Collective.
void consolidate(ZeroEngine& engine, const std::string& file);

}  // namespace dtc::l07
