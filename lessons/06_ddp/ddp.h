// Lesson 06 contract: data-parallel training (DDP), built by hand.
//
// LibTorch's C++ API has no DistributedDataParallel: here you write one, in the steps PyTorch's
// own took. Every rank holds a full replica of the model, trains on its own shard of the global
// batch, and averages the gradients with the other ranks before the optimizer step, so that every
// replica takes the very same step. This header is the whole specification of what you implement
// in ddp.cpp; README.md beside it teaches it. Build and test:
//
//   make test-lesson06          # your exercise, test by test
//   make run-lesson06           # the program on 2 ranks: build/bin/lesson06 --help
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dtc/compat.h"

namespace dtc::l06 {

// ---------------------------------------------------------------------------------------------
// Step 2: an identical start
// ---------------------------------------------------------------------------------------------

/// Makes every rank's replica of @p module equal to rank 0's: broadcast every parameter and
/// every buffer (module.parameters() then module.buffers(), in that order) from rank 0, in
/// place.
///
/// Call it once, after building the model and before the first step. All ranks must call it
/// (it is a collective). Parameters are leaves that require grad: write into them under
/// torch::NoGradGuard, or broadcast their .data() (no autograd history either way).
void broadcast_parameters(torch::nn::Module& module, Comm& comm);

// ---------------------------------------------------------------------------------------------
// Steps 3 and 4: averaging gradients after backward
// ---------------------------------------------------------------------------------------------

/// The naive DDP: after backward, one collective per parameter whose grad is defined, in the
/// order of @p params. On return every such p.grad() is the mean of that gradient over all
/// ranks, on every rank. (gloo in LibTorch 1.13 has no ReduceOp::AVG.)
/// Every rank must pass the same parameters in the same order.
void allreduce_gradients_naive(const std::vector<torch::Tensor>& params, Comm& comm);

/// The flattened DDP: the same means as allreduce_gradients_naive(), with ONE collective for
/// all the defined gradients together; each p.grad() keeps its shape. Fewer, larger messages:
/// one latency instead of one per parameter.
void allreduce_gradients_flat(const std::vector<torch::Tensor>& params, Comm& comm);

// ---------------------------------------------------------------------------------------------
// Step 5: buckets, overlapped with backward
// ---------------------------------------------------------------------------------------------

/// Groups parameters into buckets for the Reducer.
///
/// Walk @p params in REVERSE order (backward produces the last layer's gradients first) and
/// append each parameter's index to the current bucket; a bucket is closed as soon as its bytes
/// (sum of numel * element_size) reach @p bucket_bytes or more. A parameter is never split: one
/// larger than the cap joins the open bucket and closes it (parameters of 400 and 16 bytes,
/// cap 100 -> {{1, 0}}). The last bucket may be smaller.
/// @return the buckets, first to fill first: e.g. 4 parameters of 100 bytes, cap 200 ->
///   {{3, 2}, {1, 0}}.
/// @throws dtc::UsageError("--bucket-kb") when @p bucket_bytes < 1.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<torch::Tensor>& params,
                                                int64_t bucket_bytes);

/// PyTorch DDP's Reducer, in small: gradient hooks copy each gradient into its bucket (a flat
/// buffer) as backward produces it; when a bucket is complete, its allreduce(SUM) is launched
/// asynchronously, while backward goes on computing earlier layers. finish() waits for them
/// and writes the mean gradients into p.grad().
///
/// Use: build it once after broadcast_parameters; per step, zero the grads, forward, backward,
/// reducer.finish(), optimizer.step(). Every rank must build it with the same parameters and
/// cap (the buckets, and the order of the collectives, must agree across ranks).
class Reducer {
 public:
  /// Assigns the buckets (assign_buckets), makes one flat zero buffer per bucket (on the
  /// parameters' device and dtype), and registers one gradient hook per parameter that calls
  /// on_grad(index, grad).
  /// @p first_bucket_bytes > 0: PyTorch's bucket rebuild. The first synced backward also
  /// records the order in which the gradients became ready (hooks of the Reducer's own, given);
  /// its finish() then takes rank 0's order (one broadcast, so that every rank's buckets agree,
  /// PyTorch's sync_bucket_indices) and assigns the buckets again along it: the first one
  /// capped at @p first_bucket_bytes, the others at @p bucket_bytes (assign_buckets on the
  /// parameters in that order), and lays them out (lay_out()). From the second step on, each
  /// bucket holds gradients that arrive together, whatever order the parameters were
  /// registered in. 0: the buckets of the constructor for good.
  Reducer(std::vector<torch::Tensor> params, c10::intrusive_ptr<Comm> comm, int64_t bucket_bytes,
          int64_t first_bucket_bytes = 0);
  /// Removes the hooks.
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  /// no_sync: while false, backward only accumulates gradients locally (no hook does any work);
  /// set it back to true for the last micro-step of an accumulation. Default true.
  void set_sync(bool sync) { sync_ = sync; }
  bool sync() const { return sync_; }

  /// Called by the hook of parameter @p index with its incoming gradient, BEFORE autograd adds
  /// it into p.grad() (that is when a LibTorch tensor hook runs).
  ///
  /// While sync() is true, on return: the parameter's slot in its bucket holds what p.grad() is
  /// about to hold (micro-steps accumulated under no_sync included), and every bucket whose
  /// parameters are all ready has been launched (launch() does one bucket), none before the
  /// buckets ahead of it: every rank must issue its collectives in the same order. While
  /// sync() is false: nothing.
  void on_grad(size_t index, const torch::Tensor& grad);

  /// On return every bucket's allreduce has completed and every p.grad() is the mean over ranks,
  /// also for a parameter whose hook did not fire on this rank (it contributes its p.grad(), or
  /// zeros when it has none), except a parameter that no rank used this step (unused()[i],
  /// known only with find_unused_parameters): its p.grad() is left untouched, undefined if it
  /// was, as PyTorch's Reducer leaves it (copy_bucket_to_grad: "If a parameter is globally
  /// unused, we keep its grad untouched"), so that the optimizer skips it as it skips a
  /// parameter with no gradient in a single process; a zero gradient would still move it
  /// under AdamW (its moments' momentum and the decoupled weight decay). The per-step state
  /// is reset, so the next backward starts afresh.
  /// With a compression hook (compressed()), the hook has divided already: the bucket holds the
  /// mean when its Work is done. Does nothing while sync() is false.
  void finish();

  /// PyTorch DDP's find_unused_parameters=True: walks the autograd graph of @p output (the loss,
  /// after forward, before backward) from its grad_fn to the parameters' AccumulateGrad nodes,
  /// and marks every parameter it does not reach as ready now (its slot: its p.grad() from
  /// no_sync micro-steps, or zeros), launching, in order, the buckets that completes. Without
  /// it a bucket holding a parameter that this step's graph does not use never completes during
  /// backward, and in-order launching holds back every bucket after it until finish(): no
  /// overlap. The walk costs a traversal of the graph every step, which is why PyTorch makes it
  /// an option; static_graph=True records the unused set once instead. It also starts one
  /// allreduce of the step's used map (a parameter is used on this rank when the graph reaches
  /// it or its p.grad() holds no_sync micro-steps), which unused() waits for: PyTorch's
  /// local_used_map. Call it on every rank every synced step, or on none. Does nothing while
  /// sync() is false. Given.
  void prepare_for_backward(const torch::Tensor& output);

  /// For each parameter: true when no rank used it this step (prepare_for_backward's used map,
  /// summed over the ranks; waits for that allreduce). All false when prepare_for_backward was
  /// not called this step: without find_unused_parameters nothing tells a parameter that no
  /// rank used from one that every rank will, and finish() averages its zeros (PyTorch's
  /// Reducer refuses such a step instead: "Expected to have finished reduction in the prior
  /// iteration"). Given.
  std::vector<bool> unused();

  /// The collectives of one synced backward and finish(), with zeros: what a rank that has no
  /// batch left sends while the others train a step (DdpTrainer::join: DDP's
  /// _match_all_reduce_for_bwd_pass), and the bucket rebuild's broadcast when it is still due.
  /// Leaves the parameters' gradients alone. Given.
  void shadow_step();

  /// PyTorch's bf16_compress_hook / fp16_compress_hook (DDP's register_comm_hook): from now on
  /// each bucket is cast to @p wire_dtype (torch::kBFloat16 or torch::kHalf) and divided by the
  /// world size BEFORE its allreduce (the shares of W ranks, not their sum, must fit in 16 bits;
  /// a value already past fp16's 65504 on one rank is inf either way, and in fp16 values of
  /// about 2^-25 W (3e-8 W) or less flush to zero), and the result is cast back into the fp32
  /// bucket when the bucket's Work's wait() returns (PyTorch: a callback on the future). Half
  /// the bytes on the wire; the mean is rounded to 16 bits. With a hook the hook divides, not
  /// finish(): PyTorch's Reducer divides a bucket only without a comm hook. Register it once,
  /// before the first backward, on every rank alike. Given.
  /// @throws dtc::UsageError("--reduce-dtype") for another dtype, or bf16 over LibTorch 1.13's
  ///   gloo (no bf16 allreduce there); std::logic_error for a second hook or one registered in
  ///   the middle of a step
  void register_compress_hook(torch::ScalarType wire_dtype);
  /// Whether a compression hook is registered (finish() must not divide then).
  bool compressed() const { return wire_dtype_ != torch::kFloat; }

  /// The buckets, as parameter indices (assign_buckets; after a rebuild, in the ready order).
  const std::vector<std::vector<size_t>>& buckets() const { return buckets_; }
  /// Whether the buckets were rebuilt (after the first synced step, with first_bucket_bytes).
  bool rebuilt() const { return rebuilt_; }
  /// How many bucket allreduces were launched from inside backward (by on_grad), over the life
  /// of this reducer: the overlap. finish() launching a bucket does not count.
  int64_t launched_in_backward() const { return launched_in_backward_; }

 private:
  /// Launches the asynchronous allreduce(SUM) of bucket @p b's flat buffer and keeps its work.
  void launch(size_t b);
  /// Parameter @p index's slot in its bucket's flat buffer, viewed with the parameter's shape.
  torch::Tensor slot(size_t index) const;
  /// For buckets_: every parameter's slot (bucket_of_, offset_of_) and each bucket's flat zero
  /// buffer (flat_, the parameters' dtype and device); pending_ and work_ for a fresh step.
  void lay_out();
  /// The bucket rebuild (see the constructor): rank 0's ready order, broadcast, and new buckets.
  void rebuild_buckets();
  /// Whether the rebuild is asked for and has not happened yet.
  bool rebuild_due() const { return first_bucket_bytes_ > 0 && !rebuilt_; }

  std::vector<torch::Tensor> params_;
  c10::intrusive_ptr<Comm> comm_;
  std::vector<std::vector<size_t>> buckets_;  ///< parameter indices per bucket
  std::vector<torch::Tensor> flat_;           ///< one (numel of the bucket,) buffer per bucket
  std::vector<size_t> bucket_of_;             ///< parameter index -> its bucket
  std::vector<int64_t> offset_of_;            ///< parameter index -> its offset in the bucket
  std::vector<bool> ready_;                   ///< parameter index -> its grad is in the bucket
  std::vector<int64_t> pending_;              ///< bucket -> parameters not ready yet
  std::vector<c10::intrusive_ptr<c10d::Work>> work_;  ///< bucket -> its allreduce, or null
  size_t next_to_launch_ = 0;                         ///< buckets 0..next-1 are launched
  std::vector<unsigned> hook_ids_;                    ///< parameter index -> its hook
  bool sync_ = true;
  int64_t launched_in_backward_ = 0;
  int64_t bucket_bytes_ = 0;
  int64_t first_bucket_bytes_ = 0;  ///< > 0: rebuild the buckets after the first step
  bool rebuilt_ = false;
  torch::ScalarType wire_dtype_ = torch::kFloat;  ///< the compression hook's dtype, or kFloat
  std::vector<int64_t> ready_order_;              ///< the first synced backward's ready order
  std::vector<unsigned> order_hook_ids_;          ///< parameter index -> the hook that records it
  bool find_unused_ = false;  ///< prepare_for_backward has been called: the used map every step
  torch::Tensor used_map_;    ///< this step's used map (int32, one per parameter), being summed
  c10::intrusive_ptr<c10d::Work> used_work_;  ///< its allreduce, or null
};

/// no_sync as a scope, like PyTorch's `with model.no_sync():` block.
class NoSync {
 public:
  explicit NoSync(Reducer& reducer) : reducer_(reducer) { reducer_.set_sync(false); }
  ~NoSync() { reducer_.set_sync(true); }
  NoSync(const NoSync&) = delete;
  NoSync& operator=(const NoSync&) = delete;

 private:
  Reducer& reducer_;
};

// ---------------------------------------------------------------------------------------------
// The distributed sampler
// ---------------------------------------------------------------------------------------------

/// The same permutation that PyTorch's `torch.randperm(n, generator=g)` gives for a CPU
/// generator `g.manual_seed(seed)` (given: torch::randperm with a CPU generator seeded alike).
std::vector<int64_t> randperm(int64_t n, uint64_t seed);

/// torch.utils.data.DistributedSampler, index for index: which dataset indices rank @p rank of
/// @p num_replicas visits in one epoch.
class DistributedSampler {
 public:
  /// @throws dtc::UsageError for size < 1, num_replicas < 1, or a rank outside [0, num_replicas).
  DistributedSampler(int64_t size, int num_replicas, int rank, bool shuffle = true,
                     uint64_t seed = 0, bool drop_last = false);

  /// Reshuffle: the next indices() uses the permutation of seed + epoch. Forget it and every
  /// epoch visits the data in the same order.
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }

  /// Indices per rank in one epoch: drop_last and size not divisible by num_replicas ->
  /// ceil((size - num_replicas) / num_replicas), else ceil(size / num_replicas).
  int64_t num_samples() const;

  /// This rank's indices for the current epoch, exactly as PyTorch's sampler yields them:
  /// 1. order = randperm(size, seed + epoch) when shuffling, else 0, 1, ..., size - 1;
  /// 2. total = num_samples() * num_replicas. Without drop_last, pad order to total by
  ///    repeating it from its start (as often as needed); with drop_last, cut it to total;
  /// 3. rank r takes order[r], order[r + W], order[r + 2W], ...  (W = num_replicas).
  std::vector<int64_t> indices() const;

 private:
  int64_t size_;
  int num_replicas_;
  int rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t epoch_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Step 7: side work on rank 0 only
// ---------------------------------------------------------------------------------------------

/// Saves a checkpoint on rank 0 only, atomically; every other rank returns at once (their
/// replicas are identical: N ranks writing one file is wasted I/O at best, a torn file at worst).
///
/// Rank 0 writes one torch::serialize::OutputArchive with nested archives "model"
/// (module.save) and "optimizer" (optimizer.save) and a tensor "steps_done" (int64), first to
/// `path + ".tmp"`, then renames it to @p path (std::rename is atomic on POSIX): a reader, or a
/// crash halfway, never sees a half-written checkpoint.
/// @throws std::exception when the file cannot be written.
void save_checkpoint(const std::string& path, int rank, torch::nn::Module& module,
                     torch::optim::Optimizer& optimizer, int64_t steps_done);

/// Loads a checkpoint written by save_checkpoint() into @p module and @p optimizer (same
/// shapes). Every rank calls it and reads the same file.
/// @return steps_done.
/// @throws std::exception when the file is missing or is not such a checkpoint.
int64_t load_checkpoint(const std::string& path, torch::nn::Module& module,
                        torch::optim::Optimizer& optimizer);

}  // namespace dtc::l06
