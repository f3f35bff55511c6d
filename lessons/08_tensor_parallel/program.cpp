// The lesson08 program: trains the course's GPT split over a dp x tp grid of ranks, and prints
// the communication volume that tensor parallelism puts on the wire per layer. Given in full; the
// tensor-parallel modules are yours, in tensor_parallel.cpp.
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <map>
#include <ostream>

#include "dtc/cli.h"
#include "dtc/digest.h"
#include "dtc/errors.h"
#include "dtc/format.h"
#include "dtc/program.h"

namespace dtc::l08 {

// ---------------------------------------------------------------------------------------------
// The rank grid
// ---------------------------------------------------------------------------------------------

Mesh make_mesh(int world, int dp, int tp) {
  // Neither given: all ranks split each layer (tp inferred, dp 1).
  if (dp == 0 && tp == 0) dp = 1;
  return Mesh::build(world, {{"dp_replicate", dp, "--dp"}, {"tp", tp, "--tp"}});
}

Groups make_groups(const c10::intrusive_ptr<c10d::Store>& store, const Mesh& mesh, int rank,
                   BackendKind backend, std::chrono::milliseconds timeout,
                   const std::string& master_addr) {
  const MeshGroups groups(store, mesh, rank, {{"tp"}, {"dp_replicate"}}, backend, timeout,
                          master_addr);
  return Groups{groups.get({"tp"}), groups.get({"dp_replicate"})};
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

TpRunResult train_tp(const TrainConfig& c, Comm& tp, Comm& dp, const TpRunOptions& o) {
  validate_tp(c.model, tp.getSize());
  check_precision(c.precision, /*bf16_collectives=*/true);
  if (c.batch % dp.getSize() != 0) {
    throw UsageError("--global-batch",
                     fmt::format("{} sequences do not split over dp {}", c.batch, dp.getSize()),
                     "pass a global batch that dp divides, e.g. --global-batch 8 --dp 2");
  }
  // The full model first, with the baseline's exact weights; then this rank keeps its slices.
  Gpt full = make_gpt(c.model, c.seed, o.device);
  TpGpt model(full, tp);
  model->set_overlap_dgrad(o.overlap_dgrad);
  full = Gpt(nullptr);  // the full copy is freed: from here on, each rank holds 1/tp of it
  MasterAdamW optimizer(*model, c.precision, adamw_options(c));  // bf16: casts the model
  const ByteDataset data = ByteDataset::builtin();
  const int64_t rows = c.batch / dp.getSize();
  const int64_t first_row = dp.getRank() * rows;
  TpRunResult result;
  for (int64_t step = 0; step < o.steps; ++step) {
    const Batch batch = data.batch(c.seed, step, rows, c.model.ctx, first_row).to(o.device);
    optimizer.zero_grad();
    torch::Tensor loss = model->loss(batch);  // this replica's rows, the same on its TP ranks
    loss.backward();
    average_gradients(*model, dp);  // DP: the mean over the replicas = the global batch's
    optimizer.step();
    torch::Tensor global = loss.detach().clone();
    allreduce_(global, dp);
    const float value = global.item<float>() / static_cast<float>(dp.getSize());
    result.losses.push_back(value);
    if (o.on_step) o.on_step(step, value);
  }
  if (o.weights) {
    for (const auto& w : optimizer.master()) result.weights.push_back(w.detach().clone());
  }
  if (o.digest) {
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
    const auto named = model->named_parameters();
    for (size_t i = 0; i < named.size(); ++i) {
      const auto& item = named[i];
      const std::string name = item.key() == "lm_head" ? "lm_head.weight" : item.key();
      torch::Tensor value = optimizer.master()[i];             // fp32: the parameter itself
      if (name == "wte.weight" || name == "lm_head.weight") {  // without the padding rows
        value = value.narrow(0, 0, model->wte->vocab_end - model->wte->vocab_begin);
      }
      const bool split = value.numel() != full_numel.at(name);
      if (dp.getRank() == 0 && (split || tp.getRank() == 0)) pieces.emplace_back(name, value);
    }
    result.digest = param_digest(names, pieces, std::vector<Comm*>{&tp, &dp});
  }
  return result;
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
  int dp = 0;
  int tp = 0;
  bool overlap_dgrad = false;  // --overlap-dgrad
};

std::string human_time(double s) {
  if (s >= 1) return fmt::format("{:.2f} s", s);
  if (s >= 1e-3) return fmt::format("{:.2f} ms", s * 1e3);
  return fmt::format("{:.1f} us", s * 1e6);
}

void print_volume(std::ostream& out, const std::string& what, int64_t b, int64_t s, int64_t h,
                  int tp, int64_t bytes, int64_t layers) {
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

// The grid the flags ask for. Neither --dp nor --tp: tp = the world size when the model splits
// that many ways (2 or 4 ranks here), else the largest tp that divides both (8 GPUs, 4 heads:
// tp 4 x dp 2).
Mesh choose_mesh(int world, const Options& o, const GptConfig& model) {
  int tp = o.tp;
  for (int t = world; o.tp == 0 && o.dp == 0 && t >= 1 && tp == 0; --t) {
    if (world % t != 0) continue;
    try {
      validate_tp(model, t);
      tp = t;
    } catch (const UsageError&) {
    }
  }
  const Mesh mesh = make_mesh(world, o.dp, tp);
  validate_tp(model, mesh.size("tp"));
  return mesh;
}

void print_report(std::ostream& out, const TrainConfig& c, const Mesh& mesh, const StepLog& log) {
  const auto& losses = log.losses();
  fmt::print(out, "\n  trained {} steps: loss {:.4f} -> {:.4f}, {:.0f} tokens/s, {:.1f} s\n",
             losses.size(), losses.front(), losses.back(), log.tokens_per_s(), log.elapsed_s());
  fmt::print(out,
             "\nCommunication volume of tensor parallelism (Megatron: 2 allreduces forward, 2\n"
             "backward, per layer, each of the b x s x h activations; ring allreduce sends\n"
             "2(tp-1)/tp of it per rank):\n");
  print_volume(out, fmt::format("this run, {}", precision_name(c.precision)),
               c.batch / mesh.size("dp_replicate"), c.model.ctx, c.model.hidden, mesh.size("tp"),
               c.precision == Precision::kFp32 ? 4 : 2, c.model.layers);
  print_volume(out, "GPT-3 175B layer, bf16, tp 8", 1, 2048, 12288, 8, 2, 96);
  fmt::print(
      out,
      "\n  NVLink 4 moves 900 GB/s per GPU counting both directions, 450 GB/s each way; an\n"
      "  InfiniBand NDR port 400 Gb/s = 50 GB/s each way. The same bytes take 9x longer between\n"
      "  nodes, and they sit on the critical path of every layer (the next matmul waits for the\n"
      "  allreduce): keep each TP group inside one node, and let DP or PP cross nodes.\n");
}

int run(const TrainOptions& t, const Options& o, std::ostream& out, std::ostream& err) {
  // 1. Configuration, checked on every rank before the network is touched.
  const TrainConfig c = t.run_config();
  Job job = Job::prepare(t.train.backend, std::chrono::seconds(t.timeout_s));
  const Mesh mesh = choose_mesh(job.env.world_size, o, c.model);
  const int dp = mesh.size("dp_replicate"), tp = mesh.size("tp");
  check_precision(c.precision, /*bf16_collectives=*/true);
  if (c.batch % dp != 0) {
    throw UsageError("--global-batch",
                     fmt::format("{} sequences do not split over dp {}", c.batch, dp),
                     "pass a global batch that --dp divides");
  }

  // 2. Build: the process group, then the TP and DP subgroups of the grid.
  job.trace_dir = t.trace;  // --trace DIR: a timeline of every rank
  job.connect();
  Groups groups =
      make_groups(job.store, mesh, job.rank(), job.backend, job.timeout, job.env.master_addr);
  // with --trace, on the timeline by group, each span with its group's global ranks
  groups.tp = job.traced(groups.tp, "tp", mesh.group(job.rank(), {"tp"}));
  groups.dp = job.traced(groups.dp, "dp", mesh.group(job.rank(), {"dp_replicate"}));
  const bool talk = job.rank0() && !t.train.json;
  if (talk) {
    print_banner(
        out, "Lesson 08: tensor parallelism", job, c.model, count_parameters(*Gpt(c.model)),
        {{"grid", fmt::format("{} ranks = dp {} x tp {} (tp fastest: TP groups are consecutive "
                              "ranks)",
                              mesh.world(), dp, tp)},
         {"split",
          fmt::format("each rank: {} of {} heads, MLP {} of {}, vocabulary rows {} of {}",
                      c.model.heads / tp, c.model.heads, c.model.ffn() / tp, c.model.ffn(),
                      padded_vocab(c.model.vocab, tp) / tp, padded_vocab(c.model.vocab, tp))},
         {"train", fmt::format("AdamW lr {:g}, {} steps, global batch {} ({} per replica), seed {}",
                               c.lr, t.train.steps, c.batch, c.batch / dp, c.seed)},
         {"numerics", c.precision == Precision::kFp32
                          ? std::string("precision fp32, recompute none")
                          : fmt::format("precision {} (fp32 master weights), recompute none",
                                        precision_name(c.precision))}});
  }

  // 3. The loop (train_tp), one progress line per tenth of the run.
  StepLog log(err, talk, 0, t.train.steps, c.batch * c.model.ctx);
  TpRunOptions run;
  run.steps = t.train.steps;
  run.device = job.device;
  run.on_step = [&](int64_t step, float loss) {
    log.end_step(step, loss);
    log.begin_step();
  };
  run.overlap_dgrad = o.overlap_dgrad;
  run.digest = true;
  const TpRunResult result = train_tp(c, *groups.tp, *groups.dp, run);

  // 4. Report, 5. finish.
  job.finish();
  if (!job.rank0()) return kExitOk;
  if (t.train.json) {
    const CommVolume v = tp_comm_volume(c.batch / dp, c.model.ctx, c.model.hidden, tp,
                                        c.precision == Precision::kFp32 ? 4 : 2);
    nlohmann::json j = run_json(log, t.train.steps, job.device);
    add_job_json(j, job, c, Recompute::kNone, result.digest);
    j["dp"] = dp;
    j["tp"] = tp;
    j["comm_per_layer"] = {{"allreduces", v.allreduces},
                           {"bytes_each", v.bytes_each},
                           {"bytes_per_layer", v.bytes_per_layer},
                           {"wire_bytes_per_rank", v.wire_bytes_per_rank},
                           {"nvlink_s", v.nvlink_s},
                           {"infiniband_s", v.infiniband_s}};
    print_json_line(out, j);
    return kExitOk;
  }
  print_report(out, c, mesh, log);
  return kExitOk;
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  TrainCli cli(
      "lesson08",
      "Lesson 08: tensor parallelism. Trains the course's GPT with each layer split over --tp\n"
      "ranks (Megatron-LM style) and --dp replicas; run it under torchrun, e.g.\n"
      "  torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson08");
  cli.add_timeout_flag();
  cli.add_precision_flag({Precision::kFp32, Precision::kBf16});
  Options o;
  CLI::App& app = cli.app();
  app.add_option("--tp", o.tp,
                 "ranks that split each layer (default: world size / dp; with neither flag, the "
                 "world size, or its largest divisor that also divides the model)")
      ->check(positive_count("--tp 2"));
  app.add_option("--dp", o.dp, "data-parallel replicas (default: world size / tp)")
      ->check(positive_count("--dp 2"));
  app.add_flag("--overlap-dgrad", o.overlap_dgrad,
               "backward: overlap each column-parallel layer's input-gradient allreduce with its "
               "weight-gradient matmul (Megatron's async dgrad allreduce)");
  return cli.run(argc, argv, err, [&] { return run(cli.options(), o, out, err); });
}

int run_main(int argc, char** argv) { return run_program(argc, argv, std::cout, std::cerr); }

}  // namespace dtc::l08
