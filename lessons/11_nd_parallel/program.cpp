// The lesson11 program: trains the course's GPT on a dp x tp x pp mesh (the mix in the planner's
// grammar), lesson 08's tensor-parallel blocks inside lesson 09's pipeline stages, with the
// reduction, the tied embedding and the clipping you wrote in nd.cpp. Given in full.
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <chrono>
#include <cmath>
#include <iostream>
#include <limits>
#include <ostream>

#include "dtc/cli.h"
#include "dtc/errors.h"
#include "dtc/memory.h"
#include "dtc/program.h"
#include "ledger.h"

namespace dtc::l11 {
namespace {

struct Flags {
  std::string mix;  // --mix; empty: every rank a dp replica
  int virtual_stages = 0;
  int hsdp = 0;
  std::string schedule = "1f1b";
  double clip = 0;
  std::string norm_type = "2";
  std::string attention = "ring";
  bool zigzag = false;
  bool sequence_parallel = false;
};

// Lesson 01's ledger for this run's model and mix (AdamW, fp32 or mixed): the device that holds
// the most, the first pipeline stage, with every parameter split by tp and ZeRO over the dp x cp
// ranks.
l01::Ledger predicted_ledger(const NdOptions& o) {
  const l01::ModelConfig model{"run",          l01::Arch::kGpt, o.model.hidden,
                               o.model.layers, o.model.heads,   o.model.heads,
                               o.model.ffn(),  o.model.vocab,   o.model.ctx};
  l01::TrainingSetup s;
  // bf16: 16-bit parameters and gradients, fp32 master weights and moments (the ledger's kMixed)
  s.precision = o.precision == Precision::kFp32 ? l01::Precision::kFp32 : l01::Precision::kMixed;
  s.optimizer = l01::Optimizer::kAdam;
  s.zero_stage = o.mix.zero_stage;
  s.dp = (o.mix.shard > 0 ? o.mix.shard : o.mix.dp) * o.mix.cp;  // the ranks ZeRO shards over
  s.tp = o.mix.tp;
  s.pp = o.mix.pp;
  s.seq = o.model.ctx / o.mix.cp;
  s.micro_batch = o.mix.micro_batch;
  return l01::compute_ledger(l01::count_params(model), s, &model);
}

// Why rank 0's counted state differs from the ledger's, when it does.
std::string memory_note(const NdOptions& o) {
  std::string note;
  if (o.mix.tp > 1) {
    note +=
        "  tp replicates the LayerNorms, the row-parallel biases and (here) the embeddings, "
        "which the\n  ledger divides by tp: the count is above the ledger by (1 - 1/tp) of "
        "them.\n";
  }
  if (o.mix.pp == 1) {
    note +=
        "  one stage keeps the head as a second tensor (the tied copy, or lm_head): V h "
        "that the\n  ledger's tied GPT counts once.\n";
  }
  if (o.mix.zero_stage > 0) {
    note += fmt::format(
        "  ZeRO cuts each parameter into {} chunks of ceil(numel / n): rank 0's are the\n"
        "  full ones, a few elements above the ledger's even 1/n.\n",
        o.mix.shard > 0 ? "N x cp (HSDP's group)" : "dp x cp");
  }
  if (o.mix.zero_stage >= 2) {
    note +=
        "  counted at rest, after the step: within a step, a pipeline's micro-batches accumulate "
        "into\n  whole gradients (and ZeRO-3 gathers whole parameters for all of them), freed "
        "after the\n  reduce-scatter and the optimizer.\n";
  }
  return note;
}

int run(const TrainOptions& t, const Flags& f, std::ostream& out, std::ostream& err) {
  // 1. Configuration, checked on every rank before the network is touched.
  Job job = Job::prepare(t.train.backend, std::chrono::seconds(t.timeout_s));
  const int world = job.env.world_size;
  NdOptions o;
  static_cast<RunConfig&>(o) = t.run_config();
  o.steps = t.train.steps;
  o.mix = parse_mix(f.mix.empty() ? fmt::format("{}x1x1x1", world) : f.mix, "--mix");
  if (f.virtual_stages > 0) o.mix.virtual_stages = f.virtual_stages;
  if (f.hsdp > 0) {  // the mix's hsdpN: ZeRO-3 within groups of N dp ranks
    if (f.hsdp < 2 || o.mix.dp % f.hsdp != 0 || o.mix.cp > 1 ||
        (o.mix.shard > 0 && o.mix.shard != f.hsdp)) {
      throw UsageError(
          "--hsdp",
          fmt::format("groups of {} over the mix's {} dp ranks{}", f.hsdp, o.mix.dp,
                      o.mix.cp > 1 ? " with cp above 1" : ""),
          "pass a G of 2 or more that divides the mix's DP, with CP 1 (--mix 4x2x1x1 --hsdp 2), "
          "or write it in the mix (4x2x1x1:hsdp2)");
    }
    o.mix.shard = f.hsdp;
    o.mix.zero_stage = 3;
  }
  o.schedule = o.mix.virtual_stages > 1 && f.schedule == "1f1b" ? l09::ScheduleKind::kInterleaved
                                                                : l09::parse_schedule(f.schedule);
  o.clip = f.clip;
  o.norm_type = f.norm_type == "inf" ? std::numeric_limits<double>::infinity() : 2.0;
  o.attention = f.attention == "ulysses"     ? l10::Attention::kUlysses
                : f.attention == "allgather" ? l10::Attention::kAllGather
                                             : l10::Attention::kRing;
  o.zigzag = f.zigzag;
  o.sequence_parallel = f.sequence_parallel;
  o.device = job.device;
  o.digest = true;
  check_nd(o, world);

  // 2. Build: the process group, then this rank's groups over the mesh.
  job.trace_dir = t.trace;
  job.connect();
  // The counting allocator on the CPU: what the forwards in flight hold (StepOut's
  // activation_bytes).
  if (job.device.is_cpu()) install_counting_allocator();
  const Mesh mesh = make_mesh(o.mix, world);
  const NdGroups groups = make_groups(job.store, mesh, job.rank(), o.mix.zero_stage, job.backend,
                                      job.timeout, job.env.master_addr, job.tracer);
  const bool talk = job.rank0() && !t.train.json;
  if (talk) {
    print_banner(
        out, "Lesson 11: N-D parallelism", job, o.model, count_parameters(*Gpt(o.model)),
        {{"mix", fmt::format("{} = {}", o.mix.text(), mesh.describe())},
         {"pipeline",
          fmt::format("{} stages{}, {} schedule, {} micro-batches of {} sequences", mesh.size("pp"),
                      o.mix.virtual_stages > 1 ? fmt::format(" x {} chunks", o.mix.virtual_stages)
                                               : std::string(),
                      l09::schedule_name(o.schedule), micro_batches(o), o.mix.micro_batch)},
         {"embedding", o.model.tied ? "tied: wte on the first stage, its copy on the last"
                                    : "untied (a separate lm_head)"},
         {"train", fmt::format("AdamW lr {:g}, {} steps, global batch {}, seed {}, {}", o.lr,
                               o.steps, o.batch, o.seed,
                               o.clip > 0 ? fmt::format("clip {:g} ({}-norm)", o.clip, f.norm_type)
                                          : std::string("no clipping"))}});
  }

  // 3. The loop.
  StepLog log(err, talk, 0, o.steps, o.batch * o.model.ctx);
  log.begin_step();
  const NdResult result = train_nd(o, groups, &log);

  // 4. Report, 5. finish.
  job.finish();
  if (!job.rank0()) return kExitOk;
  const l01::Ledger ledger = predicted_ledger(o);  // rank 0's state, as lesson 01 predicts it
  if (t.train.json) {
    nlohmann::json j = run_json(log, o.steps, job.device);
    add_job_json(j, job, o, o.mix.recompute == "full" ? Recompute::kFull : Recompute::kNone,
                 result.digest);
    j["mix"] = o.mix.text();
    j["dp"] = mesh.size(std::vector<std::string>{"dp_replicate", "dp_shard"});
    j["zero_stage"] = o.mix.zero_stage;
    j["precision"] = precision_name(o.precision);
    j["hsdp"] = o.mix.shard;  // HSDP's group size N (0: none)
    // AdamW's two moments on rank 0 (the given optimizer's state; ZeRO-1: its shards only)
    j["optimizer_state_bytes"] = result.optimizer_elements * 4;
    j["memory"] = {{"rank", 0},
                   {"measured",
                    {{"params", result.memory.params},
                     {"grads", result.memory.grads},
                     {"optimizer", result.memory.optimizer},
                     {"zero_copies", result.memory.zero_copies},
                     {"masters", result.memory.masters},
                     {"activations", result.activation_bytes},
                     {"peak", result.peak_bytes}}},
                   {"predicted",
                    {{"params", ledger.state.params},
                     {"grads", ledger.state.grads},
                     {"optimizer", ledger.state.optimizer},
                     {"activations", ledger.activation_bytes},
                     {"total", ledger.total_bytes()}}},
                   {"closed_form", {{"activations", predict_activation_bytes(o, 0)}}}};
    j["tp"] = mesh.size("tp");
    j["pp"] = mesh.size("pp");
    j["cp"] = mesh.size("cp");
    j["virtual_stages"] = o.mix.virtual_stages;
    j["micro_batches"] = micro_batches(o);
    j["schedule"] = l09::schedule_name(o.schedule);
    j["tied"] = o.model.tied;
    j["clip"] = o.clip;
    j["norm_type"] = f.norm_type;
    j["grad_norms"] = result.grad_norms;
    j["attention"] = l10::attention_name(o.attention);
    j["zigzag"] = o.zigzag;
    j["sequence_parallel"] = o.sequence_parallel;
    for (const auto& [traffic, w] : result.wire_bytes) {  // rank 0's, per step
      j["comm_bytes"][traffic] = {
          {"measured", w.measured}, {"predicted", w.predicted}, {"formula", w.formula}};
    }
    print_json_line(out, j);
    return kExitOk;
  }
  const auto& losses = log.losses();
  fmt::print(out, "\n  trained {} steps on {}: loss {:.4f} -> {:.4f}, {:.0f} tokens/s, {:.1f} s\n",
             losses.size(), mesh.describe(), losses.front(), losses.back(), log.tokens_per_s(),
             log.elapsed_s());
  fmt::print(out, "  rank 0 sent per step (ring algorithms' bytes), measured / the closed form:\n");
  for (const auto& [traffic, w] : result.wire_bytes) {
    if (w.measured == 0 && w.predicted == 0) continue;
    fmt::print(out, "    {:<10} {:>10} / {:>10}   {}\n", traffic, human_bytes(w.measured),
               human_bytes(w.predicted), w.formula);
  }
  fmt::print(out, "  rank 0 keeps AdamW's moments of {} elements: {}{}\n",
             result.optimizer_elements,
             human_bytes(static_cast<double>(result.optimizer_elements) * 4),
             o.mix.zero_stage > 0 ? " (ZeRO: its shard of each parameter)" : "");
  const StateMemory& m = result.memory;
  fmt::print(out,
             "  rank 0's state, counted from its tensors / lesson 01's ledger for this mix (its "
             "first stage):\n"
             "    params     {:>10} / {:>10}\n    grads      {:>10} / {:>10}\n"
             "    optimizer  {:>10} / {:>10}   AdamW's two moments\n",
             human_bytes(static_cast<double>(m.params)), human_bytes(ledger.state.params),
             human_bytes(static_cast<double>(m.grads)), human_bytes(ledger.state.grads),
             human_bytes(static_cast<double>(m.optimizer)), human_bytes(ledger.state.optimizer));
  if (m.zero_copies > 0) {
    fmt::print(out, "    ZeRO's fp32 copies of the shards{}: {} ({})\n",
               o.mix.zero_stage == 1 ? " and their gradients" : "",
               human_bytes(static_cast<double>(m.zero_copies)),
               o.precision == Precision::kFp32
                   ? "not in the ledger"
                   : "the master weights, in the ledger's optimizer state");
  }
  if (m.masters > 0) {
    fmt::print(out,
               "    fp32 master weights: {} (in the ledger's optimizer state, with the moments)\n",
               human_bytes(static_cast<double>(m.masters)));
  }
  if (result.activation_bytes >= 0) {
    const int64_t closed = predict_activation_bytes(o, 0);
    fmt::print(out,
               "    activations {:>9} held when rank 0's first backward starts; the closed form "
               "(fp32): {}; the ledger (16-bit, with dropout): {}\n",
               human_bytes(static_cast<double>(result.activation_bytes)),
               closed >= 0 ? human_bytes(static_cast<double>(closed)) : std::string("-"),
               human_bytes(ledger.activation_bytes));
  }
  if (result.peak_bytes >= 0) {
    fmt::print(out,
               "    peak       {:>10} / {:>10}   the most rank 0 held in the last step / the "
               "ledger's total\n",
               human_bytes(static_cast<double>(result.peak_bytes)),
               human_bytes(ledger.total_bytes()));
  }
  fmt::print(out, "{}", memory_note(o));
  if (!result.grad_norms.empty()) {
    fmt::print(out, "  global gradient {}-norm: {:.4f} at the first step, {:.4f} at the last\n",
               f.norm_type, result.grad_norms.front(), result.grad_norms.back());
  }
  const std::string same = fmt::format(
      "--steps {} --layers {} --hidden {} --heads {} --seq {} --global-batch {} --seed {} --lr "
      "{:g}{}",
      o.steps, o.model.layers, o.model.hidden, o.model.heads, o.model.ctx, o.batch, o.seed, o.lr,
      o.model.tied ? "" : " --untied");
  if (o.clip > 0) {
    fmt::print(out,
               "  lesson 02 does not clip: run this with --clip 0 to compare its parameter digest\n"
               "  with build/bin/lesson02 {} --json\n",
               same);
  } else {
    fmt::print(out,
               "  --json's param_digest is lesson 02's single-device run's within fp32 rounding:\n"
               "  build/bin/lesson02 {} --json\n",
               same);
  }
  return kExitOk;
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  TrainCli cli(
      "lesson11",
      "Lesson 11: N-D parallelism. Trains the course's GPT on a mesh of dp replicas x tp ranks\n"
      "x pp stages x cp ranks, written as the planner writes a mix; run it under torchrun, e.g.\n"
      "  torchrun --standalone --nproc_per_node=8 --no_python build/bin/lesson11 --mix 2x2x2x1");
  cli.add_timeout_flag();
  cli.add_precision_flag({Precision::kFp32, Precision::kBf16});
  Flags f;
  CLI::App& app = cli.app();
  app.add_option("--mix", f.mix,
                 "DPxTPxPPxCP[:ZERO[:RECOMPUTE[:MICRO[:VIRTUAL]]]], lesson 01's grammar (its "
                 "plan.mix); the degrees multiply to the world size; ZERO 0-3 (ZeRO over dp x "
                 "cp) or hsdpN (ZeRO-3 within groups of N dp ranks). Default: every rank a dp "
                 "replica");
  app.add_option("--virtual-stages", f.virtual_stages,
                 "model chunks per pipeline stage (interleaved 1F1B); overrides the mix's VIRTUAL")
      ->check(positive_count("--virtual-stages 2"));
  app.add_option("--hsdp", f.hsdp,
                 "ZeRO-3 over groups of G dp ranks, replicated across them (the mix's hsdpG)")
      ->check(positive_count("--hsdp 2"));
  app.add_option("--schedule", f.schedule,
                 "1f1b, zb-h1 or gpipe (interleaved when the mix has VIRTUAL above 1)")
      ->check(one_of({"1f1b", "zb-h1", "gpipe", "interleaved"}, "a pipeline schedule"))
      ->capture_default_str();
  app.add_option("--clip", f.clip,
                 "clip the global gradient norm to this (0: off; 1.0 is Megatron's default)")
      ->capture_default_str();
  app.add_option("--norm-type", f.norm_type, "the clipping norm: 2 or inf")
      ->check(one_of({"2", "inf"}, "a gradient norm"))
      ->capture_default_str();
  app.add_option("--attention", f.attention,
                 "with CP above 1: ring, ulysses or allgather (lesson 10's attentions)")
      ->check(one_of({"ring", "ulysses", "allgather"}, "a context-parallel attention"))
      ->capture_default_str();
  app.add_flag(
      "--zigzag", f.zigzag,
      "with CP above 1: lesson 10's zig-zag split of each sequence (balanced causal work)");
  app.add_flag("--sequence-parallel", f.sequence_parallel,
               "with TP above 1: Megatron's sequence parallelism inside each stage's blocks "
               "(lesson 10's part 5)");
  return cli.run(argc, argv, err, [&] { return run(cli.options(), f, out, err); });
}

int run_main(int argc, char** argv) { return run_program(argc, argv, std::cout, std::cerr); }

}  // namespace dtc::l11
