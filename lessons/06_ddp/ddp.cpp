// Lesson 06: your first DDP, built by hand. Implements lessons/06_ddp/ddp.h.
//
// Fill in every TODO(L06) below, top to bottom; `make test-lesson06` runs 2 and 3 thread-ranks
// of your DDP against a single-process baseline and PyTorch's losses, checks your sampler
// against PyTorch's DistributedSampler, and resumes from your checkpoint. Then run the program:
//
//   make run-lesson06 ARGS="--steps 20 --seed 1"     # torchrun, 2 ranks (README section 3)
#include "ddp.h"

#include <fmt/format.h>

#include <cstdio>
#include <utility>

#include "dtc/errors.h"
#include "dtc/todo.h"

namespace dtc::l06 {

// ---------------------------------------------------------------------------------------------
// Step 2: an identical start
// ---------------------------------------------------------------------------------------------

void broadcast_parameters(torch::nn::Module& module, Comm& comm) {
  // TODO(L06): broadcast every parameter's .data(), then every buffer, from rank 0 (root
  //   rank 0 is the default of c10d::BroadcastOptions), waiting for each
  DTC_TODO("L06", "broadcast every parameter's .data(), then every buffer, from rank 0 (root "
                  "rank 0 is the default of c10d::BroadcastOptions), waiting for each");
}

// ---------------------------------------------------------------------------------------------
// Steps 3 and 4: averaging after backward
// ---------------------------------------------------------------------------------------------

void allreduce_gradients_naive(const std::vector<torch::Tensor>& params, Comm& comm) {
  // TODO(L06): for each parameter with a defined grad: allreduce(SUM) the grad in place,
  //   wait, divide by the world size
  DTC_TODO("L06", "for each parameter with a defined grad: allreduce(SUM) the grad in place, "
                  "wait, divide by the world size");
}

void allreduce_gradients_flat(const std::vector<torch::Tensor>& params, Comm& comm) {
  // TODO(L06): cat every defined grad (flattened) into one buffer, allreduce(SUM) it once,
  //   divide by the world size, and copy each slice back into its grad
  DTC_TODO("L06", "cat every defined grad (flattened) into one buffer, allreduce(SUM) it once, "
                  "divide by the world size, and copy each slice back into its grad");
}

// ---------------------------------------------------------------------------------------------
// Step 5: buckets, overlapped with backward
// ---------------------------------------------------------------------------------------------

std::vector<std::vector<size_t>> assign_buckets(const std::vector<torch::Tensor>& params,
                                                int64_t bucket_bytes) {
  if (bucket_bytes < 1) {
    throw UsageError("--bucket-kb",
                     fmt::format("a bucket cap of {} bytes is too small", bucket_bytes),
                     "pass a positive size, e.g. --bucket-kb 1024 (PyTorch's default is 25 MB)");
  }
  std::vector<std::vector<size_t>> buckets;
  // TODO(L06): walk the parameters from last to first; append each index to the current
  //   bucket, and close the bucket once its bytes reach bucket_bytes
  DTC_TODO("L06", "walk the parameters from last to first; append each index to the current "
                  "bucket, and close the bucket once its bytes reach bucket_bytes");
  return buckets;
}

Reducer::Reducer(std::vector<torch::Tensor> params, c10::intrusive_ptr<Comm> comm,
                 int64_t bucket_bytes)
    : params_(std::move(params)), comm_(std::move(comm)) {
  buckets_ = assign_buckets(params_, bucket_bytes);
  const size_t n = params_.size();
  bucket_of_.assign(n, 0);
  offset_of_.assign(n, 0);
  ready_.assign(n, false);
  pending_.resize(buckets_.size());  // no parameter of any bucket is ready yet
  for (size_t b = 0; b < buckets_.size(); ++b) {
    pending_[b] = static_cast<int64_t>(buckets_[b].size());
  }
  work_.assign(buckets_.size(), {});
  // TODO(L06): for each bucket, record every parameter's bucket and offset, and make a flat
  //   zero buffer (total numel,) with the parameters' dtype and device; then register one hook
  //   per parameter that calls on_grad(i, grad), keeping its id in hook_ids_
  DTC_TODO("L06", "for each bucket, record every parameter's bucket and offset, and make a flat "
                  "zero buffer (total numel,) with the parameters' dtype and device; then register one hook "
                  "per parameter that calls on_grad(i, grad), keeping its id in hook_ids_");
}

Reducer::~Reducer() {
  for (size_t i = 0; i < hook_ids_.size(); ++i) params_[i].remove_hook(hook_ids_[i]);
}

void Reducer::launch(size_t b) {
  std::vector<at::Tensor> tensors{flat_[b]};
  work_[b] = comm_->allreduce(tensors);  // asynchronous: returns at once, runs on gloo's threads
}

void Reducer::on_grad(size_t index, const torch::Tensor& grad) {
  // TODO(L06): unless no_sync: copy grad (+ p.grad() when defined) into the parameter's
  //   slice of its bucket, mark it ready, and when its bucket is complete launch every complete
  //   bucket from next_to_launch_ on, in order, counting them in launched_in_backward_
  DTC_TODO("L06", "unless no_sync: copy grad (+ p.grad() when defined) into the parameter's "
                  "slice of its bucket, mark it ready, and when its bucket is complete launch every complete "
                  "bucket from next_to_launch_ on, in order, counting them in launched_in_backward_");
}

void Reducer::finish() {
  if (!sync_) return;
  // TODO(L06): launch the buckets not launched yet (missing grads: p.grad() or zeros);
  //   then per bucket wait, divide by the world size, and copy each slice into p.grad();
  //   finally reset ready_, pending_, work_ and next_to_launch_
  DTC_TODO("L06", "launch the buckets not launched yet (missing grads: p.grad() or zeros); "
                  "then per bucket wait, divide by the world size, and copy each slice into p.grad(); "
                  "finally reset ready_, pending_, work_ and next_to_launch_");
}

// ---------------------------------------------------------------------------------------------
// The distributed sampler
// ---------------------------------------------------------------------------------------------

std::vector<int64_t> randperm(int64_t n, uint64_t seed) {
  // PyTorch: g = torch.Generator(); g.manual_seed(seed); torch.randperm(n, generator=g).
  // The same CPU generator (mt19937) and the same randperm kernel give the same permutation
  // (checked against PyTorch 2.15 and 1.13 in tests/reference/lesson06_sampler.json).
  auto generator = at::detail::createCPUGenerator(seed);
  const auto perm = torch::randperm(n, generator, torch::kLong);
  return std::vector<int64_t>(perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + n);
}

DistributedSampler::DistributedSampler(int64_t size, int num_replicas, int rank, bool shuffle,
                                       uint64_t seed, bool drop_last)
    : size_(size),
      num_replicas_(num_replicas),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last) {
  if (size < 1) {
    throw UsageError("dataset", fmt::format("{} samples: nothing to sample", size),
                     "use a longer corpus or a shorter --seq");
  }
  if (num_replicas < 1 || rank < 0 || rank >= num_replicas) {
    throw UsageError("rank", fmt::format("rank {} of {} replicas", rank, num_replicas),
                     "the rank must be in [0, num_replicas)");
  }
}

int64_t DistributedSampler::num_samples() const {
  // TODO(L06): ceil((size - W) / W) with drop_last and a remainder, else ceil(size / W)
  DTC_TODO("L06", "ceil((size - W) / W) with drop_last and a remainder, else ceil(size / W)");
}

std::vector<int64_t> DistributedSampler::indices() const {
  std::vector<int64_t> mine;
  // TODO(L06): permutation of seed + epoch (or 0..size-1), padded by repeating its start
  //   (or cut with drop_last) to num_samples * W, then every W-th index from this rank's
  DTC_TODO("L06", "permutation of seed + epoch (or 0..size-1), padded by repeating its start "
                  "(or cut with drop_last) to num_samples * W, then every W-th index from this rank's");
  return mine;
}

// ---------------------------------------------------------------------------------------------
// Step 7: checkpoints, on rank 0 only
// ---------------------------------------------------------------------------------------------

void save_checkpoint(const std::string& path, int rank, torch::nn::Module& module,
                     torch::optim::Optimizer& optimizer, int64_t steps_done) {
  // TODO(L06): rank 0 only: archive "model", "optimizer" and "steps_done", save it to
  //   path + ".tmp", then std::rename it to path (throw when the rename fails)
  DTC_TODO("L06", "rank 0 only: archive \"model\", \"optimizer\" and \"steps_done\", save it to "
                  "path + \".tmp\", then std::rename it to path (throw when the rename fails)");
}

int64_t load_checkpoint(const std::string& path, torch::nn::Module& module,
                        torch::optim::Optimizer& optimizer) {
  // TODO(L06): load_from(path); read "model" into the module, "optimizer" into the
  //   optimizer, and return "steps_done"
  DTC_TODO("L06", "load_from(path); read \"model\" into the module, \"optimizer\" into the "
                  "optimizer, and return \"steps_done\"");
}

}  // namespace dtc::l06
// exercise generated from solutions/06_ddp/ddp.cpp by scripts/exercises.py; checksum fd3a546d79438f1d
