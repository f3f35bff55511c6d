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
#include <ostream>
#include <thread>

#include "dtc/cli.h"
#include "dtc/compat.h"
#include "dtc/digest.h"
#include "dtc/dist.h"
#include "dtc/errors.h"
#include "dtc/launch.h"
#include "dtc/model_flags.h"
#include "dtc/todo.h"

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
  Gpt model(config.model);
  init_weights(model, seed);
  model->to(device);
  return model;
}

std::unique_ptr<torch::optim::AdamW> make_optimizer(Gpt& model, const TrainConfig& config) {
  auto options =
      torch::optim::AdamWOptions(config.lr).betas({0.9, 0.999}).eps(1e-8).weight_decay(0.01);
  return std::make_unique<torch::optim::AdamW>(model->parameters(), options);
}

torch::Tensor forward_loss(Gpt& model, const Batch& batch) {
  auto logits = model->forward(batch.inputs);  // (B, T, V)
  return torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}),
                                              batch.targets.reshape({-1}));
}

// ---------------------------------------------------------------------------------------------
// Each rank's shard of the global batch
// ---------------------------------------------------------------------------------------------

void check_batch_split(int64_t global_batch, int world, int64_t accum) {
  if (accum < 1) {
    throw UsageError("--accum", fmt::format("{} micro-steps per step", accum),
                     "pass 1 (no accumulation) or more");
  }
  const int64_t parts = world * accum;
  if (global_batch < 1 || global_batch % parts != 0) {
    const int64_t lower = std::max<int64_t>(parts, global_batch / parts * parts);
    throw UsageError(
        "--global-batch",
        fmt::format("{} sequences do not split into {} ranks x {} micro-steps of equal size",
                    global_batch, world, accum),
        fmt::format("pass a multiple of {} (e.g. {} or {}); equal shards keep the mean of the "
                    "ranks' mean losses equal to the global mean",
                    parts, lower, lower + parts));
  }
}

std::vector<Batch> rank_batches(const ByteDataset& data, const TrainConfig& config, int64_t step,
                                int rank, int world) {
  const int64_t rows = config.global_batch / world;  // this rank's share of the global batch
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
    reducer_ = std::make_unique<Reducer>(params_, comm_, config_.bucket_bytes);
  }
}

float DdpTrainer::step(const std::vector<Batch>& micro_batches) {
  zero_grad_to_none(*optimizer_);
  const auto n = static_cast<int64_t>(micro_batches.size());
  double local_loss = 0;
  for (int64_t m = 0; m < n; ++m) {
    const Batch batch = micro_batches[static_cast<size_t>(m)].to(device_);
    // Divide by the number of micro-steps: the accumulated gradient is then the mean over all
    // this rank's rows, as if they had been one batch.
    auto loss = forward_loss(model_, batch) / static_cast<double>(n);
    if (reducer_ && m + 1 < n) {
      NoSync no_sync(*reducer_);  // inner micro-steps: accumulate locally, no communication
      loss.backward();
    } else {
      loss.backward();  // bucketed: the hooks launch the allreduces while this runs
    }
    local_loss += loss.item<double>();
  }
  switch (config_.sync) {
    case SyncMode::kNaive: allreduce_gradients_naive(params_, *comm_); break;
    case SyncMode::kFlat: allreduce_gradients_flat(params_, *comm_); break;
    case SyncMode::kBucketed: reducer_->finish(); break;
  }
  optimizer_->step();
  // The global mean loss, for logs and --json only (training never reads it): one 4-byte
  // allreduce of this rank's mean loss, divided by the world size.
  std::vector<at::Tensor> loss{torch::full({1}, local_loss, torch::kFloat).to(device_)};
  comm_->allreduce(loss)->wait();
  return loss[0].cpu().item<float>() / static_cast<float>(comm_->getSize());
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

const char* const kPitfalls[] = {"none",           "device-from-rank", "no-set-epoch",
                                 "all-ranks-save", "uneven-steps",     "no-broadcast"};

struct Options {
  TrainFlags flags;
  GptConfig model;
  bool untied = false;
  double lr = TrainConfig{}.lr;
  std::string sync = "bucketed";
  double bucket_kb = 256;
  int64_t accum = 1;
  std::string data = "steps";
  int64_t epoch_windows = 0;
  std::string save;
  std::string resume;
  int timeout_s = 60;
  std::string pitfall = "none";
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string head(const std::vector<int64_t>& v, size_t n = 6) {
  std::string s;
  for (size_t i = 0; i < std::min(n, v.size()); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return "[" + s + (v.size() > n ? ", ...]" : "]");
}

// Part 2 of the skeleton: the device. CUDA ranks use cuda:<LOCAL_RANK>; the pitfall uses RANK,
// which on a second node is past the last GPU of that node.
torch::Device pick_device(const LaunchEnv& env, BackendKind backend, bool from_rank,
                          std::ostream& err) {
  const int index = from_rank ? env.rank : env.local_rank;
  if (from_rank) {
    fmt::print(err,
               "[rank {}] --pitfall device-from-rank: device index = RANK = {} (LOCAL_RANK is "
               "{}). On 2 nodes x {} GPUs, rank {} would ask its node for cuda:{}, which does "
               "not exist there: 'invalid device ordinal'. Use LOCAL_RANK.\n",
               env.rank, env.rank, env.local_rank, env.local_world_size,
               env.local_world_size + env.local_rank, env.local_world_size + env.local_rank);
    err.flush();
  }
  if (backend != BackendKind::kNccl) return torch::Device(torch::kCPU);
  const int count = static_cast<int>(torch::cuda::device_count());
  if (count == 0) {
    throw UsageError("--backend", "nccl needs CUDA devices, and this process sees none",
                     "use --backend gloo on a CPU machine");
  }
  if (index >= count) {
    throw UsageError(
        from_rank ? "RANK" : "LOCAL_RANK",
        fmt::format("device cuda:{} asked for, but this node has {} GPU(s)", index, count),
        from_rank ? "pick the device from LOCAL_RANK, not RANK"
                  : fmt::format("start at most {} ranks per node", count));
  }
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

int run(const Options& o, std::ostream& out, std::ostream& err) {
  // Check the flags before touching the network: bad input is exit 2 on every rank.
  TrainConfig c;
  c.model = o.model;
  c.model.tied = !o.untied;
  c.global_batch = o.flags.global_batch;
  c.seed = o.flags.seed;
  c.lr = o.lr;
  c.sync = parse_sync(o.sync);
  c.accum = o.accum;
  c.bucket_bytes = static_cast<int64_t>(std::llround(o.bucket_kb * 1024.0));
  validate(c.model);
  check_learning_rate(c.lr);
  if (c.bucket_bytes < 1) {
    throw UsageError("--bucket-kb", fmt::format("{} KB is not a bucket size", o.bucket_kb),
                     "pass a positive size, e.g. --bucket-kb 256");
  }
  if (o.epoch_windows < 0) {
    throw UsageError("--epoch-windows", fmt::format("{} windows", o.epoch_windows),
                     "pass 0 (the whole corpus) or a positive count");
  }
  if (o.timeout_s < 1) {
    throw UsageError("--timeout-s", fmt::format("{} s", o.timeout_s),
                     "pass at least 1: how long a collective may wait before it fails");
  }
  if (std::find(std::begin(kPitfalls), std::end(kPitfalls), o.pitfall) == std::end(kPitfalls)) {
    throw UsageError("--pitfall",
                     fmt::format("'{}' is not a pitfall this program shows", o.pitfall),
                     "use device-from-rank, no-set-epoch, all-ranks-save, uneven-steps or "
                     "no-broadcast");
  }
  const bool epochs = o.data == "epochs" || o.pitfall == "no-set-epoch";
  if (o.data != "steps" && o.data != "epochs") {
    throw UsageError("--data", fmt::format("'{}' is not a data order", o.data),
                     "use steps (lesson 02's batches, the default) or epochs (DistributedSampler)");
  }
  if (o.pitfall == "all-ranks-save" && o.save.empty()) {
    throw UsageError("--pitfall", "all-ranks-save shows what happens to --save",
                     "add --save /tmp/l06.pt");
  }
  if (!o.resume.empty() && !std::ifstream(o.resume).good()) {
    throw UsageError("--resume", fmt::format("cannot read '{}'", o.resume),
                     "pass a checkpoint written by --save");
  }
  const ByteDataset data = ByteDataset::builtin();
  data.offset(c.seed, 0, 0, c.model.ctx);  // checks that sequences fit in the corpus

  // 1. init: who am I, and join the others. One rank needs no rendezvous.
  const LaunchEnv env = read_launch_env();
  const BackendKind backend = parse_backend(o.flags.backend);
  check_batch_split(c.global_batch, env.world_size, c.accum);
  const std::chrono::milliseconds timeout(std::chrono::seconds(o.timeout_s));
  const bool rank0 = env.rank == 0;
  // 2. device: from LOCAL_RANK (the pitfall: from RANK).
  const torch::Device device = pick_device(env, backend, o.pitfall == "device-from-rank", err);
  c10::intrusive_ptr<Comm> comm;
  if (env.world_size == 1) {
    comm = new_comm(c10::make_intrusive<c10d::HashStore>(), 0, 1, backend, timeout);
  } else {
    DistOptions options;
    options.backend = backend;
    options.timeout = timeout;
    comm = init_distributed(env, options).comm;
  }
  const int rank = comm->getRank(), world = comm->getSize();

  // 3. wrap: the same weights everywhere (the pitfall: a different seed per rank, no broadcast).
  const bool no_broadcast = o.pitfall == "no-broadcast";
  DdpTrainer trainer(c, comm, device, no_broadcast ? c.seed + static_cast<uint64_t>(rank) : c.seed,
                     !no_broadcast);
  int64_t first = 0;
  if (!o.resume.empty()) first = load_checkpoint(o.resume, *trainer.model(), trainer.optimizer());
  const int64_t steps = o.flags.steps;
  if (first >= steps) {
    throw UsageError(
        "--steps",
        fmt::format("the checkpoint is already at step {}, and --steps is {}", first, steps),
        fmt::format("--steps counts from the start: pass more than {}", first));
  }

  // The epoch-based data order: the corpus as windows, one DistributedSampler per rank.
  const int64_t rows = c.global_batch / world;
  std::unique_ptr<DistributedSampler> sampler;
  int64_t steps_per_epoch = 0;
  if (epochs) {
    int64_t windows = window_count(data, c.model.ctx);
    if (o.epoch_windows > 0) windows = std::min(windows, o.epoch_windows);  // short epochs
    sampler = std::make_unique<DistributedSampler>(windows, world, rank, /*shuffle=*/true, c.seed);
    steps_per_epoch = sampler->num_samples() / rows;  // the last partial batch is dropped
    if (steps_per_epoch < 1) {
      throw UsageError("--global-batch",
                       fmt::format("{} windows per rank, fewer than one batch of {}",
                                   sampler->num_samples(), rows),
                       "pass a smaller --global-batch or --seq");
    }
  }

  const int64_t params = count_parameters(*trainer.model());
  const int64_t tokens_per_step = c.global_batch * c.model.ctx;
  if (rank0 && !o.flags.json) {
    fmt::print(out,
               "Lesson 06: data-parallel training, built by hand\n"
               "  job     {} rank(s) via {}, {} on {}, LibTorch {}\n"
               "  model   GPT, {} layers, hidden {}, {} heads, seq {}, {} head: {} parameters\n"
               "  data    {}, global batch {} = {} ranks x {} rows{}, seed {}\n"
               "  ddp     --sync {}{}, timeout {} s\n",
               world, launcher_name(env.launcher), o.flags.backend, device.str(), torch_version(),
               c.model.layers, c.model.hidden, c.model.heads, c.model.ctx,
               c.model.tied ? "tied" : "untied", params,
               epochs ? fmt::format("epochs of {} windows (DistributedSampler), {} steps each",
                                    sampler->num_samples() * world, steps_per_epoch)
                      : std::string("lesson 02's batches"),
               c.global_batch, world, rows,
               c.accum > 1 ? fmt::format(" in {} micro-steps", c.accum) : std::string(), c.seed,
               sync_name(c.sync),
               trainer.reducer() ? fmt::format(", {} buckets of <= {} KB",
                                               trainer.reducer()->buckets().size(), o.bucket_kb)
                                 : std::string(),
               o.timeout_s);
    out.flush();
  }

  // 4. train.
  const int64_t last =
      o.pitfall == "uneven-steps" && rank == world - 1 && world > 1 ? steps - 1 : steps;
  std::vector<float> losses;
  std::vector<double> step_times;
  std::vector<std::vector<int64_t>> epoch_heads;
  int64_t epoch = -1;
  std::vector<int64_t> order;
  const int64_t every = std::max<int64_t>(1, (steps - first) / 10);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t step = first; step < last; ++step) {
    std::vector<Batch> batches;
    if (epochs) {
      if (step / steps_per_epoch != epoch) {
        epoch = step / steps_per_epoch;
        if (o.pitfall != "no-set-epoch") sampler->set_epoch(epoch);  // reshuffle every epoch
        order = sampler->indices();
        epoch_heads.push_back(order);
        if (rank0 && !o.flags.json) {
          fmt::print(err, "[rank 0] epoch {}: sampler.epoch() = {}, my first windows {}\n", epoch,
                     sampler->epoch(), head(order));
        }
      }
      const int64_t pos = step % steps_per_epoch * rows;
      const std::vector<int64_t> mine(order.begin() + pos, order.begin() + pos + rows);
      const Batch all = window_batch(data, mine, c.model.ctx);
      const int64_t micro = rows / c.accum;
      for (int64_t m = 0; m < c.accum; ++m) {
        batches.push_back({all.inputs.slice(0, m * micro, (m + 1) * micro),
                           all.targets.slice(0, m * micro, (m + 1) * micro)});
      }
    } else {
      batches = rank_batches(data, c, step, rank, world);
    }
    const auto t0 = std::chrono::steady_clock::now();
    float loss = 0;
    try {
      loss = trainer.step(batches);
    } catch (const TodoError&) {
      throw;  // an unfinished exercise region: run_cli reports it (exit 3)
    } catch (const std::exception& e) {
      // A collective that cannot complete: a rank is gone, or stuck, or took another path.
      throw std::runtime_error(fmt::format(
          "[rank {}] step {}: a collective failed after at most --timeout-s {} s: {}\n"
          "HINT: another rank stopped early or is running a different number of steps (every "
          "rank must call the same collectives in the same order){}",
          rank, step, o.timeout_s, std::string(e.what()).substr(0, 300),
          o.pitfall == "uneven-steps" ? "; here --pitfall uneven-steps made the last rank stop "
                                        "one step early"
                                      : ""));
    }
    step_times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    losses.push_back(loss);
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const int64_t done = step - first + 1;
    if (rank0 && !o.flags.json && (done == 1 || (step + 1) % every == 0 || step + 1 == steps)) {
      fmt::print(err, "[rank 0] step {:>{}}/{}  loss {:.4f}  {:>7.1f}k tokens/s\n", step + 1,
                 std::to_string(steps).size(), steps, loss,
                 static_cast<double>(done * tokens_per_step) / elapsed / 1000.0);
      err.flush();
    }
  }
  if (last < steps) {
    // The uneven-steps pitfall: this rank is done, the others wait in step `last`'s allreduce.
    // Stay alive (as a rank stuck elsewhere would) so that they see a timeout, not a crash.
    fmt::print(err,
               "[rank {}] --pitfall uneven-steps: stopping after {} steps while the others run "
               "{}; they now wait for me in step {}'s allreduce until --timeout-s {} s ends it\n",
               rank, last, steps, last, o.timeout_s);
    err.flush();
    std::this_thread::sleep_for(std::chrono::seconds(o.timeout_s + 5));
    return kExitFailure;
  }
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // Rank-0 side work: the checkpoint (every rank holds the same replica).
  if (!o.save.empty()) {
    if (o.pitfall == "all-ranks-save") {
      // Every rank believes it is rank 0: W writers of one temp file and one rename each.
      try {
        save_checkpoint(o.save, /*rank=*/0, *trainer.model(), trainer.optimizer(), steps);
        fmt::print(err, "[rank {}] --pitfall all-ranks-save: I wrote {} too\n", rank, o.save);
      } catch (const std::exception& e) {
        fmt::print(err, "[rank {}] --pitfall all-ranks-save: my write failed: {}\n", rank,
                   e.what());
      }
    } else {
      save_checkpoint(o.save, rank, *trainer.model(), trainer.optimizer(), steps);
    }
  }
  // Are the replicas still the same? (The no-broadcast pitfall: they never were.)
  const double divergence = replica_divergence(trainer.model(), *comm);
  // 5. destroy: wait for everyone, then the communicator goes out of scope.
  comm->barrier()->wait();

  bool same_epoch_order = false;
  if (epoch_heads.size() >= 2) same_epoch_order = epoch_heads[0] == epoch_heads[1];
  if (!rank0) return kExitOk;
  std::vector<double> timed(
      step_times.begin() + std::min<int64_t>(2, static_cast<int64_t>(step_times.size()) - 1),
      step_times.end());  // after 2 warm-up steps
  const double step_time = median(timed);
  const double tokens_per_s =
      static_cast<double>(static_cast<int64_t>(losses.size()) * tokens_per_step) / elapsed;
  if (o.flags.json) {
    nlohmann::json j;
    j["losses"] = losses;
    j["param_digest"] = param_digest(*trainer.model());  // rank 0's replica, after the last step
    j["tokens_per_s"] = tokens_per_s;
    j["step_time_s"] = step_time;
    j["first_step"] = first;
    j["steps"] = steps;
    j["world_size"] = world;
    j["launcher"] = launcher_name(env.launcher);
    j["backend"] = o.flags.backend;
    j["device"] = device.str();
    j["sync"] = sync_name(c.sync);
    j["bucket_kb"] = o.bucket_kb;
    j["buckets"] =
        trainer.reducer() ? static_cast<int64_t>(trainer.reducer()->buckets().size()) : 0;
    j["launched_in_backward"] = trainer.reducer() ? trainer.reducer()->launched_in_backward() : 0;
    j["accum"] = c.accum;
    j["data"] = epochs ? "epochs" : "steps";
    j["params"] = params;
    j["replica_divergence"] = divergence;
    j["pitfall"] = o.pitfall;
    if (epochs) j["same_order_in_epochs_0_and_1"] = same_epoch_order;
    j["config"] = {{"layers", c.model.layers}, {"hidden", c.model.hidden},
                   {"heads", c.model.heads},   {"seq", c.model.ctx},
                   {"tied", c.model.tied},     {"batch", c.global_batch},
                   {"seed", c.seed},           {"lr", c.lr}};
    print_json_line(out, j);
    return kExitOk;
  }
  fmt::print(out,
             "\n  trained steps {}..{}: loss {:.4f} -> {:.4f}; {:.0f} tokens/s over {} ranks; "
             "median step {:.1f} ms\n",
             first, steps - 1, losses.front(), losses.back(), tokens_per_s, world,
             step_time * 1000.0);
  if (trainer.reducer()) {
    fmt::print(out, "  reducer: {} buckets, {} allreduces launched during backward\n",
               trainer.reducer()->buckets().size(), trainer.reducer()->launched_in_backward());
  }
  fmt::print(out, "  replicas: largest parameter difference between ranks {:g}{}\n", divergence,
             divergence == 0 ? " (identical)" : "   <- the replicas have drifted apart");
  if (epochs && epoch_heads.size() >= 2) {
    fmt::print(out, "  epochs 0 and 1 visit {} order{}\n",
               same_epoch_order ? "the SAME" : "a different",
               same_epoch_order ? "   <- set_epoch was never called" : " (set_epoch reshuffles)");
  }
  if (!o.save.empty()) fmt::print(out, "  checkpoint: {} (after step {})\n", o.save, steps - 1);
  return kExitOk;
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  CLI::App app{
      "Lesson 06: data-parallel training (DDP) built by hand. Run it under torchrun, e.g.\n"
      "  torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson06 --steps 20\n"
      "(without a launcher it runs as a single rank).",
      "lesson06"};
  Options o;
  add_train_flags(app, o.flags);
  add_model_flags(app, o.model, o.lr, &o.untied);
  app.add_option("--sync", o.sync, "gradient averaging: naive, flat or bucketed")
      ->capture_default_str();
  app.add_option("--bucket-kb", o.bucket_kb, "bucket cap of --sync bucketed, in KiB")
      ->capture_default_str();
  app.add_option("--accum", o.accum,
                 "micro-steps per optimizer step (gradient accumulation; communication only on "
                 "the last: no_sync)")
      ->capture_default_str();
  app.add_option("--data", o.data,
                 "steps: lesson 02's batches (default); epochs: the corpus in windows, with a "
                 "DistributedSampler and set_epoch")
      ->capture_default_str();
  app.add_option("--epoch-windows", o.epoch_windows,
                 "--data epochs: use only the first N windows (short epochs; 0: all)")
      ->capture_default_str();
  app.add_option("--save", o.save, "rank 0 writes a checkpoint here after the last step");
  app.add_option("--resume", o.resume,
                 "continue from a checkpoint written by --save (same flags; --steps counts from "
                 "step 0)");
  app.add_option("--timeout-s", o.timeout_s,
                 "seconds a collective may wait before it fails (a hang becomes an error)")
      ->capture_default_str();
  app.add_option("--pitfall", o.pitfall,
                 "show a first-time pitfall: device-from-rank, no-set-epoch, all-ranks-save, "
                 "uneven-steps, no-broadcast")
      ->capture_default_str();
  return run_cli(
      app, argc, argv, [&] { return run(o, out, err); }, err);
}

}  // namespace dtc::l06
