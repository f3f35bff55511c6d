// The lesson07 program: trains the course's GPT data-parallel at ZeRO stage 0 (DDP), 1, 2 and 3,
// measures each rank's bytes with the counting allocator next to the ledger's prediction, and
// counts the bytes each rank sends per step next to the ZeRO paper's. Given in full; the engine
// is yours, in zero.cpp.
//
//   torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson07            # all stages
//   torchrun ... build/bin/lesson07 --stage 3 --prefetch --steps 50 --json
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <ostream>
#include <thread>

#include "dtc/cli.h"
#include "dtc/digest.h"
#include "dtc/dist.h"
#include "dtc/errors.h"
#include "dtc/memory.h"
#include "dtc/mesh.h"
#include "dtc/program.h"

namespace dtc::l07 {

// ---------------------------------------------------------------------------------------------
// Predictions
// ---------------------------------------------------------------------------------------------

namespace {
double element_bytes(Precision precision) {
  return static_cast<double>(c10::elementSize(working_dtype(precision)));
}
}  // namespace

StagePrediction predict_stage_memory(int64_t psi, int stage, int world, Precision precision,
                                     Precision reduce) {
  const double p = static_cast<double>(psi), w = world;
  const double e = element_bytes(precision), e_reduce = element_bytes(reduce);
  StagePrediction s;
  s.params = stage >= 3 ? e * p / w : e * p;
  s.grads = stage >= 2 ? e_reduce * p / w : e_reduce * p;  // stages 0-1: the whole buffer
  if (precision != Precision::kFp32) s.master = stage >= 1 ? 4 * p / w : 4 * p;
  s.optimizer = stage >= 1 ? 8 * p / w : 8 * p;
  return s;
}

double predict_stage_comm(int64_t psi, int stage, int world, bool reshard_after_forward,
                          Precision precision, Precision reduce) {
  const double ring = (world - 1.0) / world * static_cast<double>(psi);
  const double e = element_bytes(precision), e_reduce = element_bytes(reduce);
  if (stage == 0) return 2 * ring * e_reduce;  // an allreduce: all of it in the reduce dtype
  const double gathers = stage >= 3 && reshard_after_forward ? 2 : 1;
  return ring * (e_reduce + gathers * e);
}

Baseline train_baseline(const GptConfig& config, uint64_t seed, int64_t batch, int64_t steps,
                        const AdamWOptions& o, double clip_norm, Precision precision) {
  const ByteDataset data = ByteDataset::builtin();
  Baseline b{Gpt(config), {}};
  init_weights(b.model, seed);
  // fp32: torch::optim::AdamW; bf16: over fp32 master weights, the model their rounding.
  MasterAdamW optimizer(*b.model, precision,
                        torch::optim::AdamWOptions(o.lr)
                            .betas({o.beta1, o.beta2})
                            .eps(o.eps)
                            .weight_decay(o.weight_decay));
  for (int64_t step = 0; step < steps; ++step) {
    const Batch x = data.batch(seed, step, batch, config.ctx);
    optimizer.zero_grad();
    auto logits = b.model->forward(x.inputs);
    auto loss = torch::nn::functional::cross_entropy(logits.view({-1, logits.size(-1)}),
                                                     x.targets.view({-1}));
    loss.backward();
    optimizer.step(clip_norm);  // clip_grad_norm_ first when clip_norm > 0
    b.losses.push_back(loss.item<float>());
  }
  if (precision != Precision::kFp32) {
    // The model returned holds the master weights, as the engine's full_parameters() does.
    const std::vector<torch::Tensor> master = optimizer.master();
    b.model->to(torch::kFloat);
    torch::NoGradGuard no_grad;
    const auto fp32 = b.model->parameters();
    for (size_t i = 0; i < fp32.size(); ++i) fp32[i].copy_(master[i]);
  }
  return b;
}

// ---------------------------------------------------------------------------------------------
// The program
// ---------------------------------------------------------------------------------------------

namespace {

struct Options {
  std::string stage = "all";
  bool prefetch = false;
  bool recompute = false;    // stage 3 (with --stage all: one more run, stage 3 recomputing)
  bool no_reshard = false;   // stage 3: keep a block's parameters from its forward to its backward
  double clip_norm = 0;      // > 0: clip the global gradient norm (every stage)
  int hsdp = 0;              // > 0: HSDP, shard groups of this many ranks (stages 2-3)
  std::string reduce_dtype;  // in bf16: "bf16" or "fp32"; empty: the working dtype
  std::string save_sharded, load_sharded, consolidate_file;
};

struct StageRun {
  int stage = 0;
  bool recompute = false;
  bool reshard = true;  // stage 3: reshard_after_forward
  std::vector<float> losses;
  double tokens_per_s = 0, step_s = 0;
  bool measured = false;
  Precision precision = Precision::kFp32, reduce = Precision::kFp32;
  int64_t params = 0, grads = 0, master = 0, optimizer = 0, peak = 0;  // bytes, this rank
  int64_t bytes_per_step = 0;            // the stage's collectives (HSDP: in the shard group)
  int64_t replicate_bytes_per_step = 0;  // HSDP: the allreduces across the replicas
  int shard_world = 1;                   // the ranks the layout shards over: W, or HSDP's G
  FlatLayout layout;
  nlohmann::json param_digest;  // the full parameters after the last step (rank 0)
};

double mib(double bytes) { return bytes / (1024.0 * 1024.0); }

// gloo's worker thread marks a collective done (wait() returns) and only then drops its own
// reference to the Work, and with it to the tensors the collective used (a receive buffer, an
// input copy). Read the counter once it has stopped moving (unchanged for 30 ms, at most 1 s):
// otherwise those few hundred KB would land in the reading now and then.
int64_t settled_current() {
  int64_t last = cpu_memory().current;
  int same = 0;
  for (int i = 0; i < 100 && same < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const int64_t now = cpu_memory().current;
    same = now == last ? same + 1 : 0;
    last = now;
  }
  return last;
}

// The global batch's loss: the mean of the ranks' means (equal rows each).
float global_mean_loss(float loss, Job& job) {
  std::vector<at::Tensor> l{torch::full({1}, loss, torch::TensorOptions().device(job.device))};
  job.comm->allreduce(l)->wait();
  return l[0].item<float>() / static_cast<float>(job.world());
}

// The full parameters (gathered: every rank takes part), cut by the layout's names and shapes,
// in the baseline model's order (dtc/digest.h); on rank 0, null elsewhere.
nlohmann::json digest(ZeroEngine& engine, const FlatLayout& layout, const GptConfig& config,
                      bool rank0) {
  const torch::Tensor full = engine.full_parameters();
  if (!rank0) return nullptr;
  std::vector<std::string> names;
  for (const auto& item : Gpt(config)->named_parameters()) names.push_back(item.key());
  std::vector<NamedPiece> pieces;
  int64_t offset = 0;
  for (const Unit& unit : layout.units) {
    for (size_t k = 0; k < unit.names.size(); ++k) {
      const int64_t n = c10::multiply_integers(unit.shapes[k]);
      pieces.emplace_back(unit.names[k], full.narrow(0, offset, n));
      offset += n;
    }
  }
  return param_digest(names, pieces);
}

// HSDP's groups: a dtc::Mesh of dp_replicate x dp_shard (PyTorch's 2-D mesh (W/G, G)), shard
// groups of G consecutive ranks (a node), replicate groups of the ranks with the same place in
// their shard group.
struct HsdpGroups {
  c10::intrusive_ptr<Comm> shard, replicate;
};

HsdpGroups hsdp_groups(Job& job, int g) {
  const Mesh mesh =
      Mesh::build(job.world(), {{"dp_replicate", 0, "--hsdp"}, {"dp_shard", g, "--hsdp"}});
  const MeshGroups groups(job.store, mesh, job.rank(), {{"dp_shard"}, {"dp_replicate"}},
                          job.backend, job.timeout, job.env.master_addr);
  return HsdpGroups{groups.get({"dp_shard"}), groups.get({"dp_replicate"})};
}

// The dtype the gradients are reduced and kept in, at every stage: --reduce-dtype, by default
// the working dtype (FSDP's MixedPrecisionPolicy with reduce_dtype=None; DDP's buckets).
Precision reduce_precision(const TrainOptions& t, const Options& o) {
  if (o.reduce_dtype.empty()) return t.precision;
  return o.reduce_dtype == "fp32" ? Precision::kFp32 : Precision::kBf16;
}

StageRun run_stage(const TrainOptions& t, const Options& o, int stage, bool recompute, Job& job,
                   const HsdpGroups& hsdp, bool talk, std::ostream& err) {
  StageRun run;
  run.stage = stage;
  run.precision = t.precision;
  run.reduce = reduce_precision(t, o);
  run.recompute = recompute;
  run.reshard = !o.no_reshard;
  const GptConfig config = t.model_config();
  const int world = job.world(), rank = job.rank();
  const int64_t rows = t.train.global_batch / world;
  const ByteDataset data = ByteDataset::builtin();
  ZeroOptions zo;
  zo.stage = stage;
  zo.prefetch = o.prefetch;
  zo.recompute = recompute;
  zo.reshard_after_forward = !o.no_reshard;
  zo.clip_norm = o.clip_norm;
  zo.adamw.lr = t.lr;
  zo.precision = run.precision;
  zo.reduce = run.reduce;

  // Build: settled readings on both sides (the previous stage's collectives may still be
  // releasing their buffers, and building the engine runs collectives of its own).
  run.measured = job.device.is_cpu();
  const int64_t before_model = settled_current();
  Gpt model(config);
  init_weights(model, t.train.seed);
  model->to(job.device);
  ZeroEngine engine(model, hsdp.shard ? hsdp.shard : job.comm, zo, hsdp.replicate);
  model = nullptr;  // the engine holds it
  run.shard_world = engine.comm().world();
  run.params = settled_current() - before_model;
  // bf16: the fp32 master weights are part of it; the engine's (given) master() says how much.
  // The sum stays the allocator's reading.
  if (engine.master().defined()) {
    run.master = static_cast<int64_t>(engine.master().storage().nbytes());
    run.params -= run.master;
  }
  run.layout = engine.layout();
  if (!o.load_sharded.empty()) load_sharded(engine, o.load_sharded);
  const int64_t first = engine.steps_done();
  check_resume_step(first, t.train.steps);

  // The loop: the first step of a fresh run is the one measured, between its phases.
  StepLog log(err, talk, first, t.train.steps, t.train.global_batch * config.ctx, "[rank 0] ");
  for (int64_t step = first; step < t.train.steps; ++step) {
    const Batch batch =
        data.batch(t.train.seed, step, rows, config.ctx, rank * rows).to(job.device);
    const int64_t bytes_before = engine.comm().bytes_sent();
    CountingComm* replicate = engine.replicate_comm();
    const int64_t replicate_before = replicate ? replicate->bytes_sent() : 0;
    const bool measure = step == first && run.measured && first == 0;
    const int64_t before = cpu_memory().current;
    if (measure) reset_cpu_peak();
    log.begin_step();
    const float loss = engine.forward_backward(batch);
    const int64_t after_backward = measure ? settled_current() : 0;
    {
      TraceSpan span("optimizer");  // with --trace (dtc/trace.h)
      engine.optimizer_step();
    }
    if (measure) {
      run.grads = after_backward - before;
      run.optimizer = settled_current() - after_backward;
    }
    run.bytes_per_step = engine.comm().bytes_sent() - bytes_before;
    run.replicate_bytes_per_step = replicate ? replicate->bytes_sent() - replicate_before : 0;
    log.end_step(step, global_mean_loss(loss, job));  // reporting, not counted
  }
  // The peak over every step: from the second on, AdamW's states are there during backward too.
  if (run.measured && first == 0) run.peak = cpu_memory().peak - before_model;
  run.losses = log.losses();
  run.step_s = log.elapsed_s() / static_cast<double>(run.losses.size());
  run.tokens_per_s = log.tokens_per_s();
  if (job.rank0()) {
    fmt::print(err, "[rank 0] stage {}{}: {} steps, loss {:.4f} -> {:.4f}, {:.1f} ms/step\n", stage,
               recompute ? " + recompute" : "", run.losses.size(), run.losses.front(),
               run.losses.back(), 1000 * run.step_s);
    err.flush();
  }
  run.param_digest = digest(engine, run.layout, config, job.rank0());
  if (!o.save_sharded.empty()) {
    std::filesystem::create_directories(o.save_sharded);
    save_sharded(engine, o.save_sharded);
  }
  if (!o.consolidate_file.empty()) consolidate(engine, o.consolidate_file);
  return run;
}

nlohmann::json stage_json(const StageRun& r) {
  const auto& L = r.layout;
  const int world = r.shard_world;
  const StagePrediction ledger =
      predict_stage_memory(L.numel, r.stage, world, r.precision, r.reduce);
  // The same formulas on the padded count: what the flat buffers hold exactly.
  const StagePrediction padded =
      predict_stage_memory(L.padded, r.stage, world, r.precision, r.reduce);
  nlohmann::json j;
  j["stage"] = r.stage;
  j["recompute"] = r.recompute;
  j["precision"] = precision_name(r.precision);
  j["reduce_dtype"] = precision_name(r.reduce);
  j["losses"] = r.losses;
  j["param_digest"] = r.param_digest;
  j["tokens_per_s"] = r.tokens_per_s;
  j["step_s"] = r.step_s;
  j["psi"] = L.numel;
  j["padded"] = L.padded;
  j["outer_padded"] = L.units.front().padded;
  j["units"] = L.units.size();
  j["memory"]["predicted"] = {{"params", ledger.params},
                              {"grads", ledger.grads},
                              {"master", ledger.master},
                              {"optimizer", ledger.optimizer}};
  j["memory"]["predicted_padded"] = {{"params", padded.params},
                                     {"grads", padded.grads},
                                     {"master", padded.master},
                                     {"optimizer", padded.optimizer}};
  if (r.measured) {
    j["memory"]["measured"] = {{"params", r.params},
                               {"grads", r.grads},
                               {"master", r.master},
                               {"optimizer", r.optimizer},
                               {"peak", r.peak}};
  } else {
    j["memory"]["measured"] = nullptr;
  }
  j["comm"] = {{"bytes_per_step", r.bytes_per_step},
               {"theory_bytes_per_step",
                predict_stage_comm(L.numel, r.stage, world, r.reshard, r.precision, r.reduce)},
               {"replicate_bytes_per_step", r.replicate_bytes_per_step}};
  j["shard_world"] = world;
  j["reshard_after_forward"] = r.reshard;
  return j;
}

void print_table(std::ostream& out, const std::vector<StageRun>& runs, int world, int job_world) {
  const StageRun& first = runs.front();
  const bool mixed = first.precision != Precision::kFp32;
  fmt::print(out,
             "\nPer rank ({}), {}: measured by the counting allocator / predicted by the "
             "ledger (ZeRO Fig. 1)\n\n",
             world == job_world
                 ? fmt::format("W = {}", world)
                 : fmt::format("HSDP: sharded over {} of the W = {} ranks", world, job_world),
             mixed ? fmt::format("bf16 + fp32 master weights + AdamW, 2 + {} + 12 bytes/param, "
                                 "gradients reduced in {}",
                                 element_bytes(first.reduce), precision_name(first.reduce))
                   : std::string("fp32 + AdamW, 4 + 4 + 8 bytes/param"));
  std::string head = fmt::format("  {:<6} {:>21} {:>21}", "stage", "params MiB", "grads MiB");
  if (mixed) head += fmt::format(" {:>21}", "master MiB");
  head += fmt::format(" {:>21} {:>16} {:>10} {:>25} {:>9}\n", "optimizer MiB", "DDP / this",
                      "peak MiB", "sent/step MiB (theory)", "ms/step");
  out << head;
  const StagePrediction ddp =
      predict_stage_memory(first.layout.numel, 0, world, first.precision, first.reduce);
  const int64_t ddp_measured =
      first.stage == 0 ? first.params + first.grads + first.master + first.optimizer : 0;
  for (const auto& r : runs) {
    const StagePrediction p =
        predict_stage_memory(r.layout.numel, r.stage, world, r.precision, r.reduce);
    auto cell = [&](int64_t m, double pred) {
      return r.measured ? fmt::format("{:.3f} / {:.3f}", mib(static_cast<double>(m)), mib(pred))
                        : fmt::format("- / {:.3f}", mib(pred));
    };
    const int64_t total = r.params + r.grads + r.master + r.optimizer;
    const std::string ratio =
        r.measured && ddp_measured > 0
            ? fmt::format("{:.2f}x ({:.2f}x)", static_cast<double>(ddp_measured) / total,
                          ddp.total() / p.total())
            : fmt::format("- ({:.2f}x)", ddp.total() / p.total());
    std::string row =
        fmt::format("  {:<6} {:>21} {:>21}",
                    r.stage == 0 ? "0 DDP" : (r.recompute ? "3 +rc" : std::to_string(r.stage)),
                    cell(r.params, p.params), cell(r.grads, p.grads));
    if (mixed) row += fmt::format(" {:>21}", cell(r.master, p.master));
    row += fmt::format(" {:>21} {:>16} {:>10} {:>25} {:>9.1f}\n", cell(r.optimizer, p.optimizer),
                       ratio,
                       r.measured ? fmt::format("{:.3f}", mib(static_cast<double>(r.peak))) : "-",
                       fmt::format("{:.3f} ({:.3f})", mib(static_cast<double>(r.bytes_per_step)),
                                   mib(predict_stage_comm(r.layout.numel, r.stage, world, r.reshard,
                                                          r.precision, r.reduce))),
                       1000 * r.step_s);
    out << row;
  }
  if (mixed) {
    // The paper's own reduction factors, from the same formulas at its Fig. 1 scale.
    auto factor = [&](int stage, int w) {
      return predict_stage_memory(1, 0, w, first.precision, first.reduce).total() /
             predict_stage_memory(1, stage, w, first.precision, first.reduce).total();
    };
    fmt::print(out,
               "\n  DDP / this, the ledger at the paper's N_d = 64: stage 1 {:.2f}x, stage 2 "
               "{:.2f}x, stage 3 {:.0f}x\n  (Fig. 1: 120 -> 31.4 -> 16.6 -> 1.9 GB; 4x, 8x and "
               "N_d x as N_d grows)\n",
               factor(1, 64), factor(2, 64), factor(3, 64));
  }
  if (runs.size() >= 4 && runs[0].measured) {
    const bool ranked =
        runs[0].peak > runs[1].peak && runs[1].peak > runs[2].peak && runs[2].peak > runs[3].peak;
    fmt::print(out,
               "\n  peak: DDP {:.3f} {} stage 1 {:.3f} {} stage 2 {:.3f} {} stage 3 {:.3f} MiB{}\n",
               mib(static_cast<double>(runs[0].peak)),
               runs[0].peak > runs[1].peak ? ">" : "<=", mib(static_cast<double>(runs[1].peak)),
               runs[1].peak > runs[2].peak ? ">" : "<=", mib(static_cast<double>(runs[2].peak)),
               runs[2].peak > runs[3].peak ? ">" : "<=", mib(static_cast<double>(runs[3].peak)),
               ranked ? "" : "   <- the ranking does not hold for this size");
  }
  if (runs.size() == 5 && runs[0].measured) {
    // What each step down the ladder saves, measured: sharding the parameters (stage 2 -> 3,
    // activations kept) and recomputation (stage 3 -> stage 3 recomputing each block).
    fmt::print(out,
               "  stage 3 + recompute: {:.3f} MiB. Of stage 2's peak, sharding the parameters "
               "saves {:.3f} MiB\n  (stage 2 -> 3) and recomputation {:.3f} MiB more (stage 3 -> "
               "3 + recompute)\n",
               mib(static_cast<double>(runs[4].peak)),
               mib(static_cast<double>(runs[2].peak - runs[3].peak)),
               mib(static_cast<double>(runs[3].peak - runs[4].peak)));
  }
  fmt::print(
      out,
      "\n  Measured parameters, gradients and optimizer states differ from the ledger by "
      "the\n  padding only (each unit is padded to a multiple of W). Stage 3 sends less than "
      "3 Psi:\n  its outer unit (embeddings, head) is gathered once per step, not twice "
      "(README).\n");
}

int run(const TrainOptions& t, const Options& o, std::ostream& out, std::ostream& err) {
  // 1. Configuration: the stages to run, checked before the network is touched.
  const GptConfig config = t.model_config();
  const std::vector<int> stages =
      o.stage == "all" ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{std::stoi(o.stage)};
  if (o.no_reshard && (stages.size() > 1 || stages.front() != 3)) {
    throw UsageError("--no-reshard-after-forward", "only stage 3 reshards after forward",
                     "pass --stage 3 --no-reshard-after-forward");
  }
  if (o.recompute && o.stage != "all" && stages.front() != 3) {
    throw UsageError("--recompute", "only stage 3 recomputes in this lesson",
                     "pass --stage 3 --recompute, or --stage all --recompute to add a run of "
                     "stage 3 recomputing beside the four stages");
  }
  if (stages.size() > 1 &&
      (!o.save_sharded.empty() || !o.load_sharded.empty() || !o.consolidate_file.empty())) {
    throw UsageError("--stage", "checkpoints need one stage",
                     "pass --stage 0, 1, 2 or 3 with --save-sharded, --load-sharded or "
                     "--consolidate");
  }

  const bool mixed = t.precision != Precision::kFp32;
  if (!o.reduce_dtype.empty() && !mixed) {
    throw UsageError("--reduce-dtype", "an fp32 model reduces its gradients in fp32",
                     "pass --precision bf16 with --reduce-dtype");
  }
  check_precision(t.precision, /*bf16_collectives=*/true);

  // 2. Build: the job, the counting allocator (before the first tensor), the process group.
  Job job = Job::prepare(t.train.backend, std::chrono::seconds(t.timeout_s));
  check_batch_split(t.train.global_batch, job.env.world_size);
  if (o.hsdp > 0) {
    if (stages.size() > 1 || stages.front() < 2) {
      throw UsageError("--hsdp", "HSDP shards stage 2 or 3",
                       "pass --stage 2 or --stage 3 with --hsdp");
    }
    if (job.env.world_size % o.hsdp != 0) {
      throw UsageError(
          "--hsdp",
          fmt::format("{} ranks do not split into shard groups of {}", job.env.world_size, o.hsdp),
          fmt::format("pass a divisor of {}, e.g. --hsdp {} (ranks per node)", job.env.world_size,
                      job.env.world_size > 1 ? 2 : 1));
    }
    if (!o.save_sharded.empty() || !o.load_sharded.empty() || !o.consolidate_file.empty()) {
      throw UsageError("--hsdp", "this lesson's checkpoints are for plain ZeRO",
                       "drop --save-sharded, --load-sharded and --consolidate, or --hsdp");
    }
  }
  install_counting_allocator();
  job.trace_dir = t.trace;  // --trace DIR: a timeline of every rank
  job.connect();
  const int world = job.world();
  const bool talk = job.rank0() && !t.train.json;
  if (talk) {
    print_banner(
        out, "Lesson 07: ZeRO", job, config, count_parameters(*Gpt(config)),
        {{"train",
          fmt::format(
              "AdamW lr {:g}, {} steps, global batch {} ({} per rank), "
              "seed {}{}",
              t.lr, t.train.steps, t.train.global_batch, t.train.global_batch / world, t.train.seed,
              std::string(o.prefetch ? ", prefetch" : "") + (o.recompute ? ", recompute" : "") +
                  (o.no_reshard ? ", no reshard after forward" : "") +
                  (o.clip_norm > 0 ? fmt::format(", clip grad norm {:g}", o.clip_norm) : "") +
                  (o.hsdp > 0 ? fmt::format(", HSDP: shard groups of {}", o.hsdp) : ""))},
         {"numerics",
          mixed ? fmt::format("precision bf16 (fp32 master weights; gradients reduced in {}), "
                              "recompute {}",
                              precision_name(reduce_precision(t, o)),
                              o.recompute ? "full (stage 3)" : "none")
                : fmt::format("precision fp32, recompute {}",
                              o.recompute ? "full (stage 3)" : "none")},
         {"stages", o.stage == "all" ? (o.recompute ? "0 (DDP), 1, 2, 3, 3 + recompute, one "
                                                      "after the other"
                                                    : "0 (DDP), 1, 2, 3, one after the other")
                                     : o.stage}});
  }

  // 3. The loop, once per stage (a progress line per tenth of the run when there is one stage).
  std::vector<StageRun> runs;
  const HsdpGroups hsdp = o.hsdp > 0 ? hsdp_groups(job, o.hsdp) : HsdpGroups{};
  for (int stage : stages) {
    const bool recompute = o.recompute && stages.size() == 1;
    runs.push_back(run_stage(t, o, stage, recompute, job, hsdp, talk && stages.size() == 1, err));
  }
  if (o.recompute && stages.size() > 1) {
    runs.push_back(run_stage(t, o, 3, true, job, hsdp, false, err));
  }

  // 4. Report, 5. finish.
  job.finish();
  if (!job.rank0()) return kExitOk;
  if (t.train.json) {
    nlohmann::json j =
        run_json(runs.back().losses, runs.back().tokens_per_s, t.train.steps, job.device);
    add_job_json(j, job, t.run_config(),
                 runs.back().recompute ? Recompute::kFull : Recompute::kNone,
                 runs.back().param_digest);
    j["reduce_dtype"] = precision_name(reduce_precision(t, o));
    j["stages"] = nlohmann::json::array();
    j["hsdp"] = o.hsdp;
    for (const auto& r : runs) j["stages"].push_back(stage_json(r));
    print_json_line(out, j);
    return kExitOk;
  }
  print_table(out, runs, runs.front().shard_world, world);
  if (o.hsdp > 0) {
    const StageRun& r = runs.front();
    const double replicas = world / o.hsdp;
    fmt::print(out,
               "  HSDP: {} replicas of shard groups of {} ranks; across the replicas, {:.3f} MiB "
               "sent a step (theory 2 (R-1)/R x the shard: {:.3f}), beside the shard group's "
               "above\n",
               replicas, o.hsdp, mib(static_cast<double>(r.replicate_bytes_per_step)),
               mib(2.0 * (replicas - 1) / replicas * 4.0 * static_cast<double>(r.layout.shard)));
  }
  if (!o.save_sharded.empty()) fmt::print(out, "  sharded checkpoint: {}/\n", o.save_sharded);
  if (!o.consolidate_file.empty()) fmt::print(out, "  consolidated: {}\n", o.consolidate_file);
  return kExitOk;
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  TrainCli cli(
      "lesson07",
      "Lesson 07: ZeRO stages 0 (DDP) to 3. Trains the course's GPT data-parallel on the ranks\n"
      "that torchrun started, measures each stage's memory per rank against the ledger and its\n"
      "bytes sent per step against the ZeRO paper.");
  cli.add_timeout_flag();
  cli.add_precision_flag({Precision::kFp32, Precision::kBf16});
  Options o;
  CLI::App& app = cli.app();
  app.add_option("--stage", o.stage, "0 (DDP), 1, 2, 3, or all (one after the other)")
      ->check(one_of({"0", "1", "2", "3", "all"}, "a ZeRO stage"))
      ->capture_default_str();
  app.add_flag("--prefetch", o.prefetch, "stage 3: gather the next block while computing this one");
  app.add_flag("--no-reshard-after-forward", o.no_reshard,
               "stage 3: keep each block's gathered parameters from its forward to its backward "
               "(FSDP's reshard_after_forward=False: 2 Psi a step instead of 3)");
  app.add_option("--clip-grad-norm", o.clip_norm,
                 "clip the global gradient norm to this before AdamW, from the shards (0: off)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--recompute", o.recompute,
               "stage 3: keep each block's input only and recompute the block in backward (with "
               "--stage all: one more run, stage 3 recomputing)");
  app.add_option("--hsdp", o.hsdp,
                 "HSDP: shard over groups of G consecutive ranks, replicate across the W/G groups "
                 "(FSDP's HYBRID_SHARD; stage 2 or 3)")
      ->check(positive_count("--hsdp 2"));
  app.add_option("--reduce-dtype", o.reduce_dtype,
                 "bf16: the dtype the gradients are reduced and kept in, bf16 or fp32 (FSDP's "
                 "MixedPrecisionPolicy reduce_dtype, Megatron's grad_reduce_in_fp32; stage 1 with "
                 "fp32 is Megatron's distributed optimizer; default: the model's dtype)")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  app.add_option("--save-sharded", o.save_sharded,
                 "after the last step, every rank writes its shard to DIR/shard-<r>-of-<W>.pt");
  app.add_option("--load-sharded", o.load_sharded,
                 "resume from a sharded checkpoint saved by any number of ranks")
      ->check(existing_directory("pass a directory written by --save-sharded"));
  app.add_option("--consolidate", o.consolidate_file,
                 "after the last step, rank 0 writes the full parameters to FILE");
  return cli.run(argc, argv, err, [&] { return run(cli.options(), o, out, err); });
}

int run_main(int argc, char** argv) { return run_program(argc, argv, std::cout, std::cerr); }

}  // namespace dtc::l07
