// The lesson08 program: trains the course's GPT split over a dp x tp grid of ranks, and prints
// the communication volume that tensor parallelism puts on the wire per layer. Given in full; the
// tensor-parallel modules are yours, in tensor_parallel.cpp.
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <chrono>
#include <cmath>
#include <map>
#include <ostream>

#include "dtc/cli.h"
#include "dtc/digest.h"
#include "dtc/errors.h"
#include "dtc/launch.h"
#include "dtc/model_flags.h"

namespace dtc::l08 {

// ---------------------------------------------------------------------------------------------
// The rank grid
// ---------------------------------------------------------------------------------------------

std::vector<int> Grid::tp_group(int rank) const {
  std::vector<int> ranks;
  for (int t = 0; t < tp; ++t) ranks.push_back(dp_rank(rank) * tp + t);
  return ranks;
}

std::vector<int> Grid::dp_group(int rank) const {
  std::vector<int> ranks;
  for (int d = 0; d < dp; ++d) ranks.push_back(d * tp + tp_rank(rank));
  return ranks;
}

Grid make_grid(int world, int dp, int tp) {
  if (dp < 0 || tp < 0 || (dp == 0 && tp == 0)) {
    if (dp < 0)
      throw UsageError("--dp", fmt::format("is {}, must be at least 1", dp), "e.g. --dp 2");
    if (tp < 0)
      throw UsageError("--tp", fmt::format("is {}, must be at least 1", tp), "e.g. --tp 2");
    return Grid{world, 1, world};  // neither given: all ranks split each layer
  }
  const char* culprit = tp == 0 ? "--dp" : "--tp";  // the flag that was given (tp if both)
  if (dp == 0) dp = world % tp == 0 ? world / tp : 0;
  if (tp == 0) tp = world % dp == 0 ? world / dp : 0;
  if (dp < 1 || tp < 1 || dp * tp != world) {
    throw UsageError(culprit, fmt::format("dp {} x tp {} is not the world size {}", dp, tp, world),
                     "choose --dp and --tp whose product is the number of ranks "
                     "(torchrun --nproc_per_node)");
  }
  return Grid{world, dp, tp};
}

Groups make_groups(const c10::intrusive_ptr<c10d::Store>& store, const Grid& grid, int rank,
                   BackendKind backend, std::chrono::milliseconds timeout,
                   const std::string& master_addr) {
  Groups g;
  g.tp = new_subgroup(store, fmt::format("tp{}", grid.dp_rank(rank)), grid.tp_group(rank), rank,
                      backend, timeout, master_addr);
  g.dp = new_subgroup(store, fmt::format("dp{}", grid.tp_rank(rank)), grid.dp_group(rank), rank,
                      backend, timeout, master_addr);
  return g;
}

// ---------------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------------

void average_gradients(torch::nn::Module& module, Comm& dp) {
  if (dp.getSize() == 1) return;
  for (auto& p : module.parameters()) {
    torch::Tensor g = p.mutable_grad();
    allreduce_(g, dp);  // SUM (1.13's gloo has no AVG)
    g.div_(dp.getSize());
  }
}

std::vector<float> train_tp(const TrainConfig& c, Comm& tp, Comm& dp, int64_t steps,
                            const torch::Device& device,
                            const std::function<void(int64_t, float)>& on_step,
                            nlohmann::json* digest) {
  validate_tp(c.model, tp.getSize());
  if (c.batch % dp.getSize() != 0) {
    throw UsageError("--global-batch",
                     fmt::format("{} sequences do not split over dp {}", c.batch, dp.getSize()),
                     "pass a global batch that dp divides, e.g. --global-batch 8 --dp 2");
  }
  // The full model first, with the baseline's exact weights; then this rank keeps its slices.
  Gpt full(c.model);
  init_weights(full, c.seed);
  full->to(device);
  TpGpt model(full, tp);
  full = Gpt(nullptr);  // the full copy is freed: from here on, each rank holds 1/tp of it
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(c.lr)
                                                         .betas({c.beta1, c.beta2})
                                                         .eps(c.eps)
                                                         .weight_decay(c.weight_decay));
  const ByteDataset data = ByteDataset::builtin();
  const int64_t rows = c.batch / dp.getSize();
  const int64_t first_row = dp.getRank() * rows;
  std::vector<float> losses;
  for (int64_t step = 0; step < steps; ++step) {
    const Batch batch = data.batch(c.seed, step, rows, c.model.ctx, first_row).to(device);
    zero_grad_to_none(optimizer);
    torch::Tensor loss = model->loss(batch);  // this replica's rows, the same on its TP ranks
    loss.backward();
    average_gradients(*model, dp);  // DP: the mean over the replicas = the global batch's
    optimizer.step();
    torch::Tensor global = loss.detach().clone();
    allreduce_(global, dp);
    const float value = global.item<float>() / static_cast<float>(dp.getSize());
    losses.push_back(value);
    if (on_step) on_step(step, value);
  }
  if (digest) {
    // Each parameter of the full model is either split over the TP ranks (a slice each) or
    // replicated on them; every DP replica holds the same. So: replica 0 contributes, a split
    // parameter from every TP rank, a replicated one from TP rank 0 only.
    std::vector<std::string> names;
    std::map<std::string, int64_t> full_numel;
    for (const auto& item : Gpt(c.model)->named_parameters()) {
      names.push_back(item.key());
      full_numel[item.key()] = item.value().numel();
    }
    std::vector<NamedPiece> pieces;
    for (const auto& item : model->named_parameters()) {
      const std::string name = item.key() == "lm_head" ? "lm_head.weight" : item.key();
      const bool split = item.value().numel() != full_numel.at(name);
      if (dp.getRank() == 0 && (split || tp.getRank() == 0))
        pieces.emplace_back(name, item.value());
    }
    *digest = param_digest(names, pieces, std::vector<Comm*>{&tp, &dp});
  }
  return losses;
}

// ---------------------------------------------------------------------------------------------
// Communication volume
// ---------------------------------------------------------------------------------------------

CommVolume tp_comm_volume(int64_t batch, int64_t seq, int64_t hidden, int tp,
                          int64_t bytes_per_element) {
  CommVolume v;
  v.allreduces = 4;  // attention's g and the MLP's g forward; their f's backward (Megatron)
  v.bytes_each = batch * seq * hidden * bytes_per_element;
  v.bytes_per_layer = v.allreduces * v.bytes_each;
  v.wire_bytes_per_rank =
      static_cast<double>(v.bytes_per_layer) * 2.0 * (tp - 1) / static_cast<double>(tp);
  // A ring allreduce sends and receives at once: what counts is the bandwidth each way.
  v.nvlink_s = v.wire_bytes_per_rank / 450e9;     // NVLink 4 (H100): 900 GB/s total, 450 each way
  v.infiniband_s = v.wire_bytes_per_rank / 50e9;  // InfiniBand NDR: 400 Gb/s = 50 GB/s each way
  return v;
}

// ---------------------------------------------------------------------------------------------
// The program
// ---------------------------------------------------------------------------------------------

namespace {

struct Options {
  TrainFlags flags;
  GptConfig model;
  bool untied = false;
  double lr = TrainConfig{}.lr;
  int dp = 0;
  int tp = 0;
  int64_t timeout_ms = 60000;
};

std::string human_bytes(double b) {
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.2f} MB", b / 1e6);
  if (b >= 1e3) return fmt::format("{:.1f} kB", b / 1e3);
  return fmt::format("{:.0f} B", b);
}

std::string human_time(double s) {
  if (s >= 1) return fmt::format("{:.2f} s", s);
  if (s >= 1e-3) return fmt::format("{:.2f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

void print_volume(std::ostream& out, const char* what, int64_t b, int64_t s, int64_t h, int tp,
                  int64_t bytes, int64_t layers) {
  const CommVolume v = tp_comm_volume(b, s, h, tp, bytes);
  fmt::print(out,
             "  {:<34} b={} s={} h={} tp={} ({} B/elem)\n"
             "    per layer per step: {} allreduces x {} = {}; each rank sends {} (ring)\n"
             "    time per layer: NVLink 450 GB/s {}, InfiniBand 50 GB/s {};"
             " x {} layers: {} vs {}\n",
             what, b, s, h, tp, bytes, v.allreduces, human_bytes(static_cast<double>(v.bytes_each)),
             human_bytes(static_cast<double>(v.bytes_per_layer)),
             human_bytes(v.wire_bytes_per_rank), human_time(v.nvlink_s), human_time(v.infiniband_s),
             layers, human_time(v.nvlink_s * static_cast<double>(layers)),
             human_time(v.infiniband_s * static_cast<double>(layers)));
}

int run(const Options& o, std::ostream& out, std::ostream& err) {
  TrainConfig c;
  c.model = o.model;
  c.model.tied = !o.untied;
  c.batch = o.flags.global_batch;
  c.seed = o.flags.seed;
  c.lr = o.lr;
  validate(c.model);
  const BackendKind backend = parse_backend(o.flags.backend);
  const LaunchEnv env = read_launch_env();
  // Everything that can be checked before connecting is checked first, on every rank.
  int tp_flag = o.tp;
  if (o.tp == 0 && o.dp == 0) {
    // Neither given: tp = the world size when the model splits that many ways (2 or 4 ranks
    // here), else the largest tp that divides both (8 GPUs, 4 heads: tp 4 x dp 2).
    for (int t = env.world_size; t >= 1 && tp_flag == 0; --t) {
      if (env.world_size % t != 0) continue;
      try {
        validate_tp(c.model, t);
        tp_flag = t;
      } catch (const UsageError&) {
      }
    }
  }
  const Grid grid = make_grid(env.world_size, o.dp, tp_flag);
  validate_tp(c.model, grid.tp);
  if (c.batch % grid.dp != 0) {
    throw UsageError("--global-batch",
                     fmt::format("{} sequences do not split over dp {}", c.batch, grid.dp),
                     "pass a global batch that --dp divides");
  }
  torch::Device device = torch::kCPU;
  if (backend == BackendKind::kNccl) {
    if (!torch::cuda::is_available()) {
      throw UsageError("--backend", "nccl needs a GPU, and none is visible",
                       "run with --backend gloo on the CPU");
    }
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  }
  const auto timeout = std::chrono::milliseconds(o.timeout_ms);

  // One rank needs no store server: a HashStore in this process.
  c10::intrusive_ptr<c10d::Store> store;
  if (env.world_size == 1) {
    store = c10::make_intrusive<c10d::HashStore>();
  } else {
    DistOptions options;
    options.backend = backend;
    options.timeout = timeout;
    store = init_distributed(env, options).store;
  }
  const Groups groups = make_groups(store, grid, env.rank, backend, timeout, env.master_addr);
  const bool talk = env.rank == 0;

  if (talk && !o.flags.json) {
    fmt::print(out,
               "Lesson 08: tensor parallelism\n"
               "  model   GPT, {} layers, hidden {}, {} heads, seq {}, vocab {}, {} head\n"
               "  grid    {} ranks = dp {} x tp {} (tp fastest: TP groups are consecutive ranks)\n"
               "  split   each rank: {} of {} heads, MLP {} of {}, vocabulary rows {} of {}\n"
               "  train   AdamW lr {:g}, {} steps, global batch {} ({} per replica), seed {}, "
               "{} (LibTorch {})\n",
               c.model.layers, c.model.hidden, c.model.heads, c.model.ctx, c.model.vocab,
               c.model.tied ? "tied" : "untied", grid.world, grid.dp, grid.tp,
               c.model.heads / grid.tp, c.model.heads, c.model.ffn() / grid.tp, c.model.ffn(),
               c.model.vocab / grid.tp, c.model.vocab, c.lr, o.flags.steps, c.batch,
               c.batch / grid.dp, c.seed, device.str(), torch_version());
    out.flush();
  }

  const int64_t steps = o.flags.steps;
  const int64_t every = std::max<int64_t>(1, steps / 10);
  const auto start = std::chrono::steady_clock::now();
  nlohmann::json digest;
  const auto losses = train_tp(
      c, *groups.tp, *groups.dp, steps, device,
      [&](int64_t step, float loss) {
        if (talk && (step == 0 || (step + 1) % every == 0 || step + 1 == steps)) {
          fmt::print(err, "step {:>{}}/{}  loss {:.4f}\n", step + 1, std::to_string(steps).size(),
                     steps, loss);
          err.flush();
        }
      },
      &digest);
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double tokens_per_s =
      static_cast<double>(steps * c.batch * c.model.ctx) / std::max(elapsed, 1e-9);
  const CommVolume v = tp_comm_volume(c.batch / grid.dp, c.model.ctx, c.model.hidden, grid.tp, 4);
  if (!talk) return kExitOk;

  if (o.flags.json) {
    nlohmann::json j;
    j["losses"] = losses;
    j["param_digest"] = digest;
    j["tokens_per_s"] = tokens_per_s;
    j["steps"] = steps;
    j["world"] = grid.world;
    j["dp"] = grid.dp;
    j["tp"] = grid.tp;
    j["device"] = device.str();
    j["config"] = {{"layers", c.model.layers}, {"hidden", c.model.hidden}, {"heads", c.model.heads},
                   {"seq", c.model.ctx},       {"vocab", c.model.vocab},   {"tied", c.model.tied},
                   {"batch", c.batch},         {"seed", c.seed},           {"lr", c.lr}};
    j["comm_per_layer"] = {{"allreduces", v.allreduces},
                           {"bytes_each", v.bytes_each},
                           {"bytes_per_layer", v.bytes_per_layer},
                           {"wire_bytes_per_rank", v.wire_bytes_per_rank},
                           {"nvlink_s", v.nvlink_s},
                           {"infiniband_s", v.infiniband_s}};
    print_json_line(out, j);
    return kExitOk;
  }
  fmt::print(out, "\n  trained {} steps: loss {:.4f} -> {:.4f}, {:.0f} tokens/s, {:.1f} s\n", steps,
             losses.front(), losses.back(), tokens_per_s, elapsed);
  fmt::print(out,
             "\nCommunication volume of tensor parallelism (Megatron: 2 allreduces forward, 2\n"
             "backward, per layer, each of the b x s x h activations; ring allreduce sends\n"
             "2(tp-1)/tp of it per rank):\n");
  print_volume(out, "this run, fp32", c.batch / grid.dp, c.model.ctx, c.model.hidden, grid.tp, 4,
               c.model.layers);
  print_volume(out, "GPT-3 175B layer, bf16, tp 8", 1, 2048, 12288, 8, 2, 96);
  fmt::print(
      out,
      "\n  NVLink 4 moves 900 GB/s per GPU counting both directions, 450 GB/s each way; an\n"
      "  InfiniBand NDR port 400 Gb/s = 50 GB/s each way. The same bytes take 9x longer between\n"
      "  nodes, and they sit on the critical path of every layer (the next matmul waits for the\n"
      "  allreduce): keep each TP group inside one node, and let DP or PP cross nodes.\n");
  return kExitOk;
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  CLI::App app{
      "Lesson 08: tensor parallelism. Trains the course's GPT with each layer split over --tp\n"
      "ranks (Megatron-LM style) and --dp replicas; run it under torchrun, e.g.\n"
      "  torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson08",
      "lesson08"};
  Options o;
  add_train_flags(app, o.flags);
  app.add_option("--tp", o.tp,
                 "ranks that split each layer (default: world size / dp; with neither flag, the "
                 "world size, or its largest divisor that also divides the model)");
  app.add_option("--dp", o.dp, "data-parallel replicas (default: world size / tp)");
  add_model_flags(app, o.model, o.lr, &o.untied);
  app.add_option("--timeout-ms", o.timeout_ms, "how long a collective may wait")
      ->capture_default_str();
  return run_cli(
      app, argc, argv, [&] { return run(o, out, err); }, err);
}

}  // namespace dtc::l08
