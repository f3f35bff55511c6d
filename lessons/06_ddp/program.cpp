// The lesson06 program: data-parallel training of the course's GPT with the DDP you wrote in
// ddp.cpp, laid out as the five-part skeleton of every DDP program (README section 2):
//
//   1. init      read the launch environment, join the process group
//   2. device    from LOCAL_RANK (never from RANK)
//   3. wrap      build the model, broadcast it from rank 0, attach the gradient averaging
//   4. train     each rank its shard of every batch (or a DistributedSampler with set_epoch)
//   5. destroy   a last barrier, then the process group goes out of scope
//
// Given in full; your part is in ddp.cpp. Run it (2 ranks, CPU, gloo):
//   torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson06_solution --json
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <ostream>
#include <thread>

#include "dtc/compat.h"
#include "dtc/digest.h"
#include "dtc/errors.h"
#include "dtc/observe.h"
#include "dtc/program.h"
#include "dtc/todo.h"
#include "dtc/trace.h"

namespace dtc::l06 {

// ---------------------------------------------------------------------------------------------
// The set-up: lesson 02's model, optimizer and loss
// ---------------------------------------------------------------------------------------------

SyncMode parse_sync(const std::string& name) {
  if (name == "naive") return SyncMode::kNaive;
  if (name == "flat") return SyncMode::kFlat;
  if (name == "bucketed") return SyncMode::kBucketed;
  throw UsageError("--sync", fmt::format("'{}' is not a way to average gradients", name),
                   "use naive (one allreduce per parameter), flat (one for all) or bucketed "
                   "(overlapped with backward, the default)");
}

const char* sync_name(SyncMode mode) {
  switch (mode) {
    case SyncMode::kNaive: return "naive";
    case SyncMode::kFlat: return "flat";
    case SyncMode::kBucketed: return "bucketed";
  }
  return "?";
}

Gpt make_model(const TrainConfig& config, uint64_t seed, const torch::Device& device) {
  return make_gpt(config.model, seed, device);
}

std::unique_ptr<torch::optim::AdamW> make_optimizer(Gpt& model, const TrainConfig& config) {
  return std::make_unique<torch::optim::AdamW>(model->parameters(), adamw_options(config));
}

torch::Tensor forward_loss(Gpt& model, const Batch& batch) {
  auto logits = model->forward(batch.inputs);  // (B, T, V)
  return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}),
                                              batch.targets.reshape({-1}));
}

// ---------------------------------------------------------------------------------------------
// Each rank's shard of the global batch
// ---------------------------------------------------------------------------------------------

std::vector<Batch> rank_batches(const ByteDataset& data, const TrainConfig& config, int64_t step,
                                int rank, int world) {
  const int64_t rows = config.batch / world;  // this rank's share of the global batch
  const int64_t micro = rows / config.accum;
  std::vector<Batch> out;
  for (int64_t m = 0; m < config.accum; ++m) {
    // Rows [rank * B/W + m * micro, ... + micro) of lesson 02's batch of this step.
    out.push_back(data.batch(config.seed, step, micro, config.model.ctx, rank * rows + m * micro));
  }
  return out;
}

int64_t window_count(const ByteDataset& data, int64_t seq) { return (data.size()) / (seq + 1); }

Batch window_batch(const ByteDataset& data, const std::vector<int64_t>& indices, int64_t seq) {
  const auto n = static_cast<int64_t>(indices.size());
  auto inputs = torch::empty({n, seq}, torch::kLong);
  auto targets = torch::empty({n, seq}, torch::kLong);
  auto in = inputs.accessor<int64_t, 2>();
  auto tg = targets.accessor<int64_t, 2>();
  const auto& bytes = data.bytes();
  for (int64_t r = 0; r < n; ++r) {
    const auto start = static_cast<size_t>(indices[static_cast<size_t>(r)] * (seq + 1));
    for (int64_t t = 0; t < seq; ++t) {
      in[r][t] = bytes[start + static_cast<size_t>(t)];
      tg[r][t] = bytes[start + static_cast<size_t>(t) + 1];
    }
  }
  return {inputs, targets};
}

// ---------------------------------------------------------------------------------------------
// One rank of DDP
// ---------------------------------------------------------------------------------------------

DdpTrainer::DdpTrainer(const TrainConfig& config, c10::intrusive_ptr<Comm> comm,
                       const torch::Device& device, uint64_t init_seed, bool broadcast)
    : config_(config), comm_(std::move(comm)), device_(device) {
  model_ = make_model(config_, init_seed, device_);
  if (broadcast) broadcast_parameters(*model_, *comm_);  // step 2: an identical start
  optimizer_ = make_optimizer(model_, config_);
  params_ = model_->parameters();
  if (config_.sync == SyncMode::kBucketed) {
    reducer_ =
        std::make_unique<Reducer>(params_, comm_, config_.bucket_bytes, config_.first_bucket_bytes);
    if (config_.reduce_dtype != torch::kFloat)
      reducer_->register_compress_hook(config_.reduce_dtype);
  }
}

float DdpTrainer::step(const std::vector<Batch>& micro_batches) {
  if (config_.join) ranks_training(true);  // Join: "I train this step" (a joined rank: 0)
  zero_grad_to_none(*optimizer_);
  const auto n = static_cast<int64_t>(micro_batches.size());
  double local_loss = 0;
  for (int64_t m = 0; m < n; ++m) {
    const Batch batch = micro_batches[static_cast<size_t>(m)].to(device_);
    // Divide by the number of micro-steps: the accumulated gradient is then the mean over all
    // this rank's rows, as if they had been one batch.
    torch::Tensor loss;
    {
      TraceSpan span("forward", n > 1 ? m : -1);  // with --trace: a span on the timeline
      loss = forward_loss(model_, batch) / static_cast<double>(n);
    }
    {
      TraceSpan span("backward", n > 1 ? m : -1);
      if (reducer_ && m + 1 < n) {
        NoSync no_sync(*reducer_);  // inner micro-steps: accumulate locally, no communication
        loss.backward();
      } else {
        loss.backward();  // bucketed: the hooks launch the allreduces while this runs
      }
    }
    local_loss += loss.item<double>();
  }
  {
    // naive and flat: the allreduces themselves; bucketed: waiting for the last buckets
    TraceSpan span("sync gradients");
    switch (config_.sync) {
      case SyncMode::kNaive: allreduce_gradients_naive(params_, *comm_); break;
      case SyncMode::kFlat: allreduce_gradients_flat(params_, *comm_); break;
      case SyncMode::kBucketed: reducer_->finish(); break;
    }
  }
  {
    TraceSpan span("optimizer");
    optimizer_->step();
  }
  // The global mean loss, for logs and --json only (training never reads it): one 4-byte
  // allreduce of this rank's mean loss, divided by the world size.
  std::vector<at::Tensor> loss{torch::full({1}, local_loss, torch::kFloat).to(device_)};
  comm_->allreduce(loss)->wait();
  return loss[0].cpu().item<float>() / static_cast<float>(comm_->getSize());
}

int64_t DdpTrainer::ranks_training(bool training) {
  std::vector<at::Tensor> active{torch::full({1}, training ? 1.0f : 0.0f).to(device_)};
  comm_->allreduce(active)->wait();
  return std::llround(active[0].cpu().item<double>());
}

void DdpTrainer::shadow_step() {
  torch::NoGradGuard no_grad;
  auto zeros_allreduce = [&](int64_t numel) {
    std::vector<at::Tensor> z{torch::zeros({numel}, torch::kFloat).to(device_)};
    comm_->allreduce(z)->wait();
  };
  switch (config_.sync) {
    case SyncMode::kNaive:  // one allreduce per parameter (every parameter is used here)
      for (const auto& p : params_) zeros_allreduce(p.numel());
      break;
    case SyncMode::kFlat: {
      int64_t numel = 0;
      for (const auto& p : params_) numel += p.numel();
      zeros_allreduce(numel);
      break;
    }
    case SyncMode::kBucketed: reducer_->shadow_step(); break;
  }
  zeros_allreduce(1);  // the step's loss: this rank adds 0
}

void DdpTrainer::join() {
  if (!config_.join) return;
  torch::NoGradGuard no_grad;
  bool last_joiner = true;             // no other rank trained a step after this one joined
  while (ranks_training(false) > 0) {  // until every rank has joined
    shadow_step();
    last_joiner = false;
  }
  // The final model: the highest of the last joiners (at least one rank shadowed nothing).
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  std::vector<at::Tensor> who{
      torch::full({1}, last_joiner ? comm_->getRank() : -1, torch::kLong).to(device_)};
  comm_->allreduce(who, max)->wait();
  const int64_t root = who[0].cpu().item<int64_t>();
  c10d::BroadcastOptions from;
  from.rootRank = root;
  for (auto& p : params_) {
    std::vector<at::Tensor> t{p.detach()};
    comm_->broadcast(t, from)->wait();
  }
  // And the root's AdamW state: an early joiner's moments and step counts missed the steps it
  // shadowed, so with the parameters alone (PyTorch's _sync_final_model) the replicas would
  // drift apart again at the next step. Per parameter: whether the root has a state, then its
  // step and both moments.
  for (auto& p : params_) {
    auto* mine = static_cast<torch::optim::AdamWParamState*>(optimizer_state(*optimizer_, p));
    std::vector<at::Tensor> has{
        torch::full({1}, mine != nullptr ? 1 : 0, torch::kLong).to(device_)};
    comm_->broadcast(has, from)->wait();
    if (has[0].cpu().item<int64_t>() == 0) continue;
    if (mine == nullptr) {
      auto fresh = std::make_unique<torch::optim::AdamWParamState>();
      fresh->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      fresh->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
      mine = static_cast<torch::optim::AdamWParamState*>(
          set_optimizer_state(*optimizer_, p, std::move(fresh)));
    }
    std::vector<at::Tensor> step{torch::full({1}, mine->step(), torch::kLong).to(device_)};
    std::vector<at::Tensor> avg{mine->exp_avg()}, avg_sq{mine->exp_avg_sq()};
    comm_->broadcast(step, from)->wait();
    comm_->broadcast(avg, from)->wait();
    comm_->broadcast(avg_sq, from)->wait();
    mine->step(step[0].cpu().item<int64_t>());
  }
}

double replica_divergence(Gpt& model, Comm& comm) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> flat;
  for (const auto& p : model->parameters()) flat.push_back(p.detach().reshape({-1}));
  const auto mine = torch::cat(flat).to(torch::kDouble);
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  std::vector<at::Tensor> hi{mine.clone()};
  std::vector<at::Tensor> neg_lo{-mine};
  comm.allreduce(hi, max)->wait();
  comm.allreduce(neg_lo, max)->wait();  // max(-x) = -min(x)
  return (hi[0] + neg_lo[0]).max().cpu().item<double>();
}

// ---------------------------------------------------------------------------------------------
// The program
// ---------------------------------------------------------------------------------------------

namespace {

struct Options {  // lesson 06's own flags (the shared ones: dtc::TrainCli)
  std::string sync = "bucketed";
  double bucket_kb = 256;
  bool rebuild_buckets = false;
  bool join = false;
  double first_bucket_kb = 64;
  std::string reduce_dtype = "fp32";
  int64_t accum = 1;
  std::string data = "steps";
  int64_t epoch_windows = 0;
  std::string save;
  std::string resume;
  std::string pitfall = "none";
};

std::string head(const std::vector<int64_t>& v, size_t n = 6) {
  std::string s;
  for (size_t i = 0; i < std::min(n, v.size()); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return "[" + s + (v.size() > n ? ", ...]" : "]");
}

// The pitfall of part 2: the device index taken from RANK, which on a second node is past the
// last GPU of that node.
torch::Device device_from_rank(const Job& job, std::ostream& err) {
  const LaunchEnv& env = job.env;
  fmt::print(err,
             "[rank {}] --pitfall device-from-rank: device index = RANK = {} (LOCAL_RANK is "
             "{}). On 2 nodes x {} GPUs, rank {} would ask its node for cuda:{}, which does "
             "not exist there: 'invalid device ordinal'. Use LOCAL_RANK.\n",
             env.rank, env.rank, env.local_rank, env.local_world_size,
             env.local_world_size + env.local_rank, env.local_world_size + env.local_rank);
  err.flush();
  return rank_device(job.backend, env.rank, "RANK", "pick the device from LOCAL_RANK, not RANK");
}

// The epoch-based data order (--data epochs): the corpus as windows, one DistributedSampler per
// rank, reshuffled by set_epoch (unless the no-set-epoch pitfall).
class EpochData {
 public:
  EpochData(const ByteDataset& data, const TrainConfig& c, int64_t max_windows, int rank, int world,
            bool set_epoch)
      : data_(data), c_(c), world_(world), rows_(c.batch / world), set_epoch_(set_epoch) {
    int64_t windows = window_count(data, c.model.ctx);
    if (max_windows > 0) windows = std::min(windows, max_windows);  // short epochs
    sampler_ = std::make_unique<DistributedSampler>(windows, world, rank, /*shuffle=*/true, c.seed);
    steps_per_epoch_ = sampler_->num_samples() / rows_;  // the last partial batch is dropped
    if (steps_per_epoch_ < 1) {
      throw UsageError("--global-batch",
                       fmt::format("{} windows per rank, fewer than one batch of {}",
                                   sampler_->num_samples(), rows_),
                       "pass a smaller --global-batch or --seq");
    }
  }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  int64_t windows() const { return sampler_->num_samples() * world_; }
  /// The orders of the epochs begun so far (their first windows go to the log).
  const std::vector<std::vector<int64_t>>& orders() const { return orders_; }
  bool same_order_in_first_two() const { return orders_.size() >= 2 && orders_[0] == orders_[1]; }

  std::vector<Batch> batches(int64_t step, bool talk, std::ostream& err) {
    if (step / steps_per_epoch_ != epoch_) {
      epoch_ = step / steps_per_epoch_;
      if (set_epoch_) sampler_->set_epoch(epoch_);  // reshuffle every epoch
      orders_.push_back(sampler_->indices());
      if (talk) {
        fmt::print(err, "[rank 0] epoch {}: sampler.epoch() = {}, my first windows {}\n", epoch_,
                   sampler_->epoch(), head(orders_.back()));
      }
    }
    const auto& order = orders_.back();
    const int64_t pos = step % steps_per_epoch_ * rows_;
    const std::vector<int64_t> mine(order.begin() + pos, order.begin() + pos + rows_);
    const Batch all = window_batch(data_, mine, c_.model.ctx);
    const int64_t micro = rows_ / c_.accum;
    std::vector<Batch> out;
    for (int64_t m = 0; m < c_.accum; ++m) {
      out.push_back({all.inputs.slice(0, m * micro, (m + 1) * micro),
                     all.targets.slice(0, m * micro, (m + 1) * micro)});
    }
    return out;
  }

 private:
  const ByteDataset& data_;
  const TrainConfig& c_;
  int world_;
  int64_t rows_;
  bool set_epoch_;
  std::unique_ptr<DistributedSampler> sampler_;
  int64_t steps_per_epoch_ = 0;
  int64_t epoch_ = -1;
  std::vector<std::vector<int64_t>> orders_;
};

// One step, with a collective's failure explained: a rank is gone, stuck, or took another path.
float step_or_explain(DdpTrainer& trainer, const std::vector<Batch>& batches, int rank,
                      int64_t step, const Options& o, int timeout_s) {
  try {
    return trainer.step(batches);
  } catch (const TodoError&) {
    throw;  // an unfinished exercise region: run_cli reports it (exit 3)
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format(
        "[rank {}] step {}: a collective failed after at most --timeout-s {} s: {}\n"
        "HINT: another rank stopped early or is running a different number of steps (every "
        "rank must call the same collectives in the same order){}",
        rank, step, timeout_s, std::string(e.what()).substr(0, 300),
        o.pitfall == "uneven-steps" ? "; here --pitfall uneven-steps made the last rank stop "
                                      "one step early"
                                    : ""));
  }
}

// The uneven-steps pitfall: this rank is done, the others wait in step `last`'s allreduce. Stay
// alive (as a rank stuck elsewhere would) so that they see a timeout, not a crash.
int stop_early(int rank, int64_t last, int64_t steps, int timeout_s, std::ostream& err) {
  fmt::print(err,
             "[rank {}] --pitfall uneven-steps: stopping after {} steps while the others run "
             "{}; they now wait for me in step {}'s allreduce until --timeout-s {} s ends it\n",
             rank, last, steps, last, timeout_s);
  err.flush();
  std::this_thread::sleep_for(std::chrono::seconds(timeout_s + 5));
  return kExitFailure;
}

// Rank-0 side work: the checkpoint (every rank holds the same replica). The all-ranks-save
// pitfall: every rank believes it is rank 0, W writers of one temp file and one rename each.
void save(const Options& o, int rank, DdpTrainer& trainer, int64_t steps, std::ostream& err) {
  if (o.save.empty()) return;
  if (o.pitfall != "all-ranks-save") {
    save_checkpoint(o.save, rank, *trainer.model(), trainer.optimizer(), steps);
    return;
  }
  try {
    save_checkpoint(o.save, /*rank=*/0, *trainer.model(), trainer.optimizer(), steps);
    fmt::print(err, "[rank {}] --pitfall all-ranks-save: I wrote {} too\n", rank, o.save);
  } catch (const std::exception& e) {
    fmt::print(err, "[rank {}] --pitfall all-ranks-save: my write failed: {}\n", rank, e.what());
  }
}

void print_banner(std::ostream& out, const Job& job, const TrainConfig& c, const Options& o,
                  DdpTrainer& trainer, const EpochData* epochs) {
  const int world = job.world();
  dtc::print_banner(
      out, "Lesson 06: data-parallel training, built by hand", job, c.model,
      count_parameters(*trainer.model()),
      {{"data",
        fmt::format("{}, global batch {} = {} ranks x {} rows{}, seed {}",
                    epochs ? fmt::format("epochs of {} windows (DistributedSampler), {} steps each",
                                         epochs->windows(), epochs->steps_per_epoch())
                           : std::string("lesson 02's batches"),
                    c.batch, world, c.batch / world,
                    c.accum > 1 ? fmt::format(" in {} micro-steps", c.accum) : std::string(),
                    c.seed)},
       {"ddp",
        fmt::format(
            "--sync {}{}{}, timeout {} s", sync_name(c.sync),
            trainer.reducer() ? fmt::format(", {} buckets of ~{} KiB",
                                            trainer.reducer()->buckets().size(), o.bucket_kb)
                              : std::string(),
            o.reduce_dtype == "fp32"
                ? std::string()
                : fmt::format(", gradients reduced in {} (compression hook)", o.reduce_dtype),
            job.timeout.count() / 1000)},
       // A bf16 model is lesson 07's and 08's (--precision bf16); DDP here trains fp32 and
       // compresses only what goes on the wire (--reduce-dtype).
       {"numerics", "precision fp32, recompute none"}});
}

int report(std::ostream& out, const Job& job, const TrainOptions& t, const TrainConfig& c,
           const Options& o, DdpTrainer& trainer, const StepLog& log, int64_t first,
           double divergence, int64_t allreduce_bytes_per_step, const EpochData* epochs) {
  const int64_t steps = t.train.steps;
  const Reducer* reducer = trainer.reducer();
  const int64_t buckets = reducer ? static_cast<int64_t>(reducer->buckets().size()) : 0;
  const int64_t in_backward = reducer ? reducer->launched_in_backward() : 0;
  const bool same_order = epochs && epochs->same_order_in_first_two();
  if (t.train.json) {
    nlohmann::json j = run_json(log, steps, job.device);
    RunConfig run = c;
    run.precision = Precision::kFp32;  // this lesson trains in fp32
    add_job_json(j, job, run, Recompute::kNone,
                 param_digest(*trainer.model()));  // rank 0's replica, after the last step
    j["step_time_s"] = log.median_step_s(/*warmup=*/2);
    j["first_step"] = first;
    j["world_size"] = job.world();
    j["sync"] = sync_name(c.sync);
    j["bucket_kb"] = o.bucket_kb;
    j["buckets"] = buckets;
    j["buckets_rebuilt"] = reducer != nullptr && reducer->rebuilt();
    j["join"] = c.join;
    j["launched_in_backward"] = in_backward;
    j["accum"] = c.accum;
    j["reduce_dtype"] = o.reduce_dtype;
    // every allreduce of a step on this rank, in bytes: the gradients (the buckets, in
    // --reduce-dtype), the 4-byte loss and, with --join, the 4-byte announcement; the
    // parameters' broadcast is not an allreduce
    j["allreduce_bytes_per_step"] = allreduce_bytes_per_step;
    j["data"] = epochs ? "epochs" : "steps";
    j["params"] = count_parameters(*trainer.model());
    j["replica_divergence"] = divergence;
    j["pitfall"] = o.pitfall;
    if (epochs) j["same_order_in_epochs_0_and_1"] = same_order;
    print_json_line(out, j);
    return kExitOk;
  }
  const auto& losses = log.losses();
  fmt::print(out,
             "\n  trained steps {}..{}: loss {:.4f} -> {:.4f}; {:.0f} tokens/s over {} ranks; "
             "median step {:.1f} ms\n",
             first, steps - 1, losses.front(), losses.back(), log.tokens_per_s(), job.world(),
             log.median_step_s(2) * 1000.0);
  if (reducer) {
    fmt::print(out, "  reducer: {} buckets{}, {} allreduces launched during backward\n", buckets,
               reducer->rebuilt() ? " (rebuilt after step 1 in the ready order)" : "", in_backward);
  }
  fmt::print(out,
             "  on the wire: {} bytes of allreduce per step per rank (gradients in {}, the "
             "loss{})\n",
             with_commas(allreduce_bytes_per_step), o.reduce_dtype,
             c.join ? ", Join's announcement" : "");
  fmt::print(out, "  replicas: largest parameter difference between ranks {:g}{}\n", divergence,
             divergence == 0 ? " (identical)" : "   <- the replicas have drifted apart");
  if (epochs && epochs->orders().size() >= 2) {
    fmt::print(out, "  epochs 0 and 1 visit {} order{}\n", same_order ? "the SAME" : "a different",
               same_order ? "   <- set_epoch was never called" : " (set_epoch reshuffles)");
  }
  if (!o.save.empty()) fmt::print(out, "  checkpoint: {} (after step {})\n", o.save, steps - 1);
  return kExitOk;
}

// The five-part skeleton of README section 2.
int run(const TrainOptions& t, const Options& o, std::ostream& out, std::ostream& err) {
  TrainConfig c(t.run_config());
  c.sync = parse_sync(o.sync);
  c.accum = o.accum;
  c.bucket_bytes = static_cast<int64_t>(std::llround(o.bucket_kb * 1024.0));
  c.join = o.join;
  if (o.reduce_dtype != "fp32") {
    if (c.sync != SyncMode::kBucketed) {
      throw UsageError("--reduce-dtype", "compresses the buckets of --sync bucketed (a comm hook)",
                       "add --sync bucketed, or drop --reduce-dtype");
    }
    // (bf16 over 1.13's gloo: Reducer::register_compress_hook says it is not there)
    c.reduce_dtype = o.reduce_dtype == "bf16" ? torch::kBFloat16 : torch::kHalf;
  }
  if (o.rebuild_buckets) {
    if (c.sync != SyncMode::kBucketed) {
      throw UsageError("--rebuild-buckets", "rebuilds the buckets of --sync bucketed",
                       "add --sync bucketed, or drop --rebuild-buckets");
    }
    c.first_bucket_bytes = std::max<int64_t>(1, std::llround(o.first_bucket_kb * 1024.0));
  }
  if (o.pitfall == "all-ranks-save" && o.save.empty()) {
    throw UsageError("--pitfall", "all-ranks-save shows what happens to --save",
                     "add --save /tmp/l06.pt");
  }
  const ByteDataset data = ByteDataset::builtin();
  data.offset(c.seed, 0, 0, c.model.ctx);  // checks that sequences fit in the corpus

  // 1. init: who am I (checked before touching the network: bad input is exit 2 on every rank),
  // then join the others. 2. device: from LOCAL_RANK (the pitfall: from RANK).
  Job job = Job::prepare(t.train.backend, std::chrono::seconds(t.timeout_s));
  check_batch_split(c.batch, job.env.world_size, c.accum);
  if (o.pitfall == "device-from-rank") job.device = device_from_rank(job, err);
  job.trace_dir = t.trace;  // --trace DIR: a timeline of every rank
  job.connect();
  const int rank = job.rank(), world = job.world();

  // 3. wrap: the same weights everywhere (the pitfall: a different seed per rank, no broadcast).
  const bool broadcast = o.pitfall != "no-broadcast";
  // The trainer talks through a recorder: the bytes its allreduces put on the wire.
  auto wire = c10::make_intrusive<RecordingComm>(job.comm);
  DdpTrainer trainer(c, wire, job.device, broadcast ? c.seed : c.seed + static_cast<uint64_t>(rank),
                     broadcast);
  const int64_t first =
      o.resume.empty() ? 0 : load_checkpoint(o.resume, *trainer.model(), trainer.optimizer());
  const int64_t steps = t.train.steps;
  check_resume_step(first, steps);
  std::unique_ptr<EpochData> epochs;
  if (o.data == "epochs" || o.pitfall == "no-set-epoch") {
    epochs = std::make_unique<EpochData>(data, c, o.epoch_windows, rank, world,
                                         o.pitfall != "no-set-epoch");
  }
  const bool talk = job.rank0() && !t.train.json;
  if (talk) print_banner(out, job, c, o, trainer, epochs.get());

  // 4. train: each rank its shard of every batch.
  const int64_t last =
      o.pitfall == "uneven-steps" && rank == world - 1 && world > 1 ? steps - 1 : steps;
  StepLog log(err, talk, first, steps, c.batch * c.model.ctx, "[rank 0] ");
  int64_t allreduce_bytes = 0;  // the steps' allreduces only (Join's last ones are not a step's)
  for (int64_t step = first; step < last; ++step) {
    const std::vector<Batch> batches =
        epochs ? epochs->batches(step, talk, err) : rank_batches(data, c, step, rank, world);
    log.begin_step();
    log.end_step(step, step_or_explain(trainer, batches, rank, step, o, t.timeout_s));
    // Counted and forgotten step by step, so that a long run's record does not grow.
    allreduce_bytes += wire->bytes("allreduce");
    wire->clear();
  }
  if (last < steps && !o.join) return stop_early(rank, last, steps, t.timeout_s, err);
  if (last < steps) {
    fmt::print(err,
               "[rank {}] --pitfall uneven-steps --join: out of batches after {} steps; "
               "shadowing the others' step {} with zeros (Join)\n",
               rank, last, last);
    err.flush();
  }
  const int64_t trained = std::max<int64_t>(1, last - first);
  const int64_t allreduce_bytes_per_step = allreduce_bytes / trained;
  trainer.join();
  save(o, rank, trainer, steps, err);
  // Are the replicas still the same? (The no-broadcast pitfall: they never were.)
  const double divergence = replica_divergence(trainer.model(), *job.comm);

  // 5. destroy: wait for everyone, then the communicator goes out of scope.
  job.finish();
  if (!job.rank0()) return kExitOk;
  return report(out, job, t, c, o, trainer, log, first, divergence, allreduce_bytes_per_step,
                epochs.get());
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  TrainCli cli(
      "lesson06",
      "Lesson 06: data-parallel training (DDP) built by hand. Run it under torchrun, e.g.\n"
      "  torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson06 --steps 20\n"
      "(without a launcher it runs as a single rank).");
  Options o;
  CLI::App& app = cli.app();
  app.add_option("--sync", o.sync, "gradient averaging: naive, flat or bucketed")
      ->check(one_of({"naive", "flat", "bucketed"}, "a way to average gradients"))
      ->capture_default_str();
  app.add_option("--bucket-kb", o.bucket_kb, "bucket cap of --sync bucketed, in KiB")
      ->check(finite_positive("--bucket-kb 256"))
      ->capture_default_str();
  app.add_flag("--rebuild-buckets", o.rebuild_buckets,
               "after step 1, bucket the parameters again in the order their gradients arrived, "
               "the first bucket small (PyTorch's DDP does it by default)");
  app.add_option("--first-bucket-kb", o.first_bucket_kb,
                 "cap of the first bucket after --rebuild-buckets, in KiB (PyTorch: 1024)")
      ->check(finite_positive("--first-bucket-kb 64"))
      ->capture_default_str();
  app.add_flag("--join", o.join,
               "uneven inputs: a rank out of batches shadows the others' collectives with zeros "
               "until all are done, then every rank takes the model of one that trained to the "
               "end (PyTorch's Join)");
  app.add_option("--reduce-dtype", o.reduce_dtype,
                 "the gradients on the wire: fp32, or bf16/fp16 through a compression hook "
                 "(PyTorch's bf16_compress_hook: cast, pre-divide, allreduce, cast back)")
      ->check(one_of({"fp32", "bf16", "fp16"}, "a dtype for the gradients' allreduce"))
      ->capture_default_str();
  app.add_option("--accum", o.accum,
                 "micro-steps per optimizer step (gradient accumulation; communication only on "
                 "the last: no_sync)")
      ->check(positive_count("--accum 2"))
      ->capture_default_str();
  app.add_option("--data", o.data,
                 "steps: lesson 02's batches (default); epochs: the corpus in windows, with a "
                 "DistributedSampler and set_epoch")
      ->check(one_of({"steps", "epochs"}, "a data order"))
      ->capture_default_str();
  app.add_option("--epoch-windows", o.epoch_windows,
                 "--data epochs: use only the first N windows (short epochs; 0: all)")
      ->check(non_negative_count("--epoch-windows 64"))
      ->capture_default_str();
  app.add_option("--save", o.save, "rank 0 writes a checkpoint here after the last step");
  app.add_option("--resume", o.resume,
                 "continue from a checkpoint written by --save (same flags; --steps counts from "
                 "step 0)")
      ->check(readable_file("pass a checkpoint written by --save"));
  cli.add_timeout_flag();
  app.add_option("--pitfall", o.pitfall,
                 "show a first-time pitfall: device-from-rank, no-set-epoch, all-ranks-save, "
                 "uneven-steps, no-broadcast")
      ->check(one_of({"none", "device-from-rank", "no-set-epoch", "all-ranks-save", "uneven-steps",
                      "no-broadcast"},
                     "a pitfall this program shows"))
      ->capture_default_str();
  return cli.run(argc, argv, err, [&] { return run(cli.options(), o, out, err); });
}

int run_main(int argc, char** argv) { return run_program(argc, argv, std::cout, std::cerr); }

}  // namespace dtc::l06
