// Lesson 06's program, and the given pieces around your DDP: the model and optimizer of lesson 02,
// each rank's shard of the global batch, the DDP training step that calls your gradient
// averaging, and the program itself (so that tests can run them in-process).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "ddp.h"
#include "dtc/data.h"
#include "dtc/model.h"

namespace dtc::l06 {

/// How gradients are averaged across ranks.
enum class SyncMode {
  kNaive,     ///< allreduce_gradients_naive after backward: one allreduce per parameter
  kFlat,      ///< allreduce_gradients_flat after backward: one allreduce over everything
  kBucketed,  ///< Reducer: bucketed allreduces launched from gradient hooks, during backward
};

/// "naive", "flat" or "bucketed". @throws UsageError("--sync") otherwise.
SyncMode parse_sync(const std::string& name);
/// The flag's spelling of @p mode.
const char* sync_name(SyncMode mode);

/// Everything that decides a data-parallel training run: lesson 02's TrainConfig
/// (dtc::RunConfig: the model, batch = the global batch, summed over all ranks, the seed,
/// AdamW's hyperparameters), plus DDP's.
struct TrainConfig : RunConfig {
  TrainConfig() = default;
  explicit TrainConfig(const RunConfig& run) : RunConfig(run) {}
  SyncMode sync = SyncMode::kBucketed;
  int64_t bucket_bytes = 256 * 1024;  ///< the Reducer's bucket cap (--bucket-kb)
  int64_t first_bucket_bytes = 0;     ///< > 0: rebuild the buckets after step 1 (--rebuild-buckets)
  bool join = false;  ///< uneven inputs: each step announces itself, done ranks shadow (--join)
  int64_t accum = 1;  ///< micro-steps per optimizer step (--accum)
  /// The gradients' dtype on the wire (--reduce-dtype): kFloat, or kBFloat16/kHalf through the
  /// Reducer's compression hook (Reducer::register_compress_hook).
  torch::ScalarType reduce_dtype = torch::kFloat;
};

/// The course's GPT for @p config, initialised from @p seed (dtc::init_weights), on @p device.
Gpt make_model(const TrainConfig& config, uint64_t seed, const torch::Device& device);
/// AdamW with lesson 02's hyperparameters over every parameter of @p model.
std::unique_ptr<torch::optim::AdamW> make_optimizer(Gpt& model, const TrainConfig& config);
/// Lesson 02's loss: mean cross-entropy of the logits (B*T, V) against the targets (B*T).
torch::Tensor forward_loss(Gpt& model, const Batch& batch);

/// Rank @p rank's micro-batches for step @p step: rows [rank * B/W, (rank + 1) * B/W) of the
/// global batch that lesson 02 trains on (ByteDataset::batch), cut into @p config.accum equal
/// micro-batches. The caller checked the split (dtc::check_batch_split).
std::vector<Batch> rank_batches(const ByteDataset& data, const TrainConfig& config, int64_t step,
                                int rank, int world);

/// One rank of DDP: the model replica, its optimizer, and the gradient averaging you wrote.
class DdpTrainer {
 public:
  /// Builds the model from @p init_seed, broadcasts it from rank 0 (unless @p broadcast is false:
  /// a pitfall), makes the optimizer and, for SyncMode::kBucketed, the Reducer.
  DdpTrainer(const TrainConfig& config, c10::intrusive_ptr<Comm> comm, const torch::Device& device,
             uint64_t init_seed, bool broadcast = true);

  /// One optimizer step on this rank's micro-batches: zero the grads; forward and backward
  /// each micro-batch with the loss divided by their number (no communication but on the last,
  /// for the Reducer: no_sync); average the gradients (naive, flat or the Reducer's finish);
  /// AdamW step.
  /// @return the GLOBAL mean loss of the step: this rank's loss averaged over the ranks with one
  ///   small allreduce (every rank gets it).
  float step(const std::vector<Batch>& micro_batches);

  /// PyTorch's Join (torch.distributed.algorithms.Join with DDP's join hook), for ranks that run
  /// out of batches at different steps: with TrainConfig::join, every step() begins with one
  /// allreduce of 1 (this rank trains a step); a rank with no batch left calls join(), which
  /// answers that allreduce with 0 and, while the sum says some rank still trains, shadows
  /// that step's collectives with zeros (the Reducer's buckets, in order: a zero gradient, the
  /// mean still divided by the initial world size, as DDP's default
  /// divide_by_initial_world_size=True), until every rank has joined. Then every rank takes
  /// the parameters of the highest of the last joiners, the ranks that shadowed no step (DDP's
  /// _sync_final_model, Join's is_last_joiner), so the replicas' parameters agree again, and
  /// that rank's AdamW state (step counts and both moments), which PyTorch's Join leaves alone:
  /// an early joiner's missed the steps it shadowed, and the replicas would drift apart at the
  /// next step (README section 6). Every rank calls it, after its last step. Does nothing
  /// without TrainConfig::join. Given.
  void join();

  Gpt& model() { return model_; }
  torch::optim::AdamW& optimizer() { return *optimizer_; }
  /// The Reducer (SyncMode::kBucketed only, else nullptr).
  const Reducer* reducer() const { return reducer_.get(); }
  Comm& comm() { return *comm_; }

 private:
  TrainConfig config_;
  c10::intrusive_ptr<Comm> comm_;
  torch::Device device_;
  Gpt model_{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<Reducer> reducer_;
  /// One step's collectives, with zeros: join()'s answer to a rank that trains.
  void shadow_step();
  /// Join's announcement: allreduces 1 if this rank trains the step, 0 if it has joined;
  /// @return how many ranks train it.
  int64_t ranks_training(bool training);
};

/// The largest elementwise difference of @p model's parameters between any two ranks (0 when
/// every replica is bit-for-bit the same): two small allreduces (MAX of x and of -x).
double replica_divergence(Gpt& model, Comm& comm);

/// The corpus cut into non-overlapping windows of seq + 1 bytes, the dataset that
/// --data epochs samples from with DistributedSampler.
int64_t window_count(const ByteDataset& data, int64_t seq);
/// The windows @p indices as a batch: (rows, seq) inputs and their next-byte targets.
Batch window_batch(const ByteDataset& data, const std::vector<int64_t>& indices, int64_t seq);

/// Runs `lesson06` with @p argv in this process, as one rank of the job the environment
/// describes (torchrun's or mpirun's variables; none: a single rank). Prints the run on @p out
/// (rank 0; with --json one JSON object on the last line), progress and errors on @p err.
/// @return the exit code: 0, 1 for a runtime failure (e.g. a collective that timed out),
///   2 for bad input (the message names the flag and the fix), 3 while a TODO(L06) is unfinished.
int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

/// run_program(argc, argv, std::cout, std::cerr): what main.cpp calls.
int run_main(int argc, char** argv);

}  // namespace dtc::l06
