// The lesson10 program: trains the course's GPT with each sequence split over a CP group of
// ranks (and the batch over dp replicas), attention through ring, Ulysses or all-gather KV, and
// prints what each attention puts on the wire per layer. Given in full; the attention is yours,
// in context_parallel.cpp.
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <chrono>
#include <iostream>
#include <map>
#include <ostream>
#include <thread>

#include "dtc/cli.h"
#include "dtc/digest.h"
#include "dtc/errors.h"
#include "dtc/format.h"
#include "dtc/memory.h"
#include "dtc/program.h"

namespace dtc::l10 {

// ---------------------------------------------------------------------------------------------
// The program
// ---------------------------------------------------------------------------------------------

namespace {

struct Options {
  int dp = 0;
  int cp = 0;
  int tp = 0;
  bool sequence_parallel = false;  // --sequence-parallel
  std::string attention = "ring";
  bool zigzag = false;
  bool no_overlap = false;  // --no-overlap
};

Attention parse_attention(const std::string& name) {
  if (name == "ulysses") return Attention::kUlysses;
  if (name == "allgather") return Attention::kAllGather;
  return Attention::kRing;
}

void print_volumes(std::ostream& out, const std::string& what, int64_t b, int64_t s, int64_t h,
                   int cp, double bytes) {
  fmt::print(out, "  {} (b={} s={} h={} cp={}, {:g} B/elem), per layer and rank:\n", what, b, s, h,
             cp, bytes);
  for (Attention kind : {Attention::kRing, Attention::kAllGather, Attention::kUlysses}) {
    const AttentionVolume v = attention_volume(kind, b, s, h, cp);
    fmt::print(out, "    {:<10} forward {:>10} ({:<16}) backward {:>10} ({})\n",
               attention_name(kind), human_bytes(v.forward * bytes), v.forward_formula,
               human_bytes(v.backward * bytes + v.backward_fp32 * 4), v.backward_formula);
  }
}

void print_report(std::ostream& out, const CpConfig& c, const Mesh& mesh, const StepLog& log) {
  const auto& losses = log.losses();
  fmt::print(out, "\n  trained {} steps: loss {:.4f} -> {:.4f}, {:.0f} tokens/s, {:.1f} s\n",
             losses.size(), losses.front(), losses.back(), log.tokens_per_s(), log.elapsed_s());
  fmt::print(out, "\nWhat attention sends (closed forms; the ring's dK/dV travel in fp32):\n");
  const double e = c.run.precision == Precision::kFp32 ? 4 : 2;
  print_volumes(out, "this run", c.run.batch / mesh.size("dp_replicate"), c.run.model.ctx,
                c.run.model.hidden, mesh.size("cp"), e);
  print_volumes(out, "a 7B-class layer (h 4096), 128k tokens, bf16, cp 8", 1, 131072, 4096, 8, 2);
  fmt::print(
      out,
      "\n  The ring sends as much as the all-gather forward, in cp - 1 steps, each posted\n"
      "  before a block's attention so that it can hide behind it. With multi-head attention\n"
      "  (this model) Ulysses sends cp/2 times less forward per rank and needs heads % cp == 0;\n"
      "  with grouped-query attention (G query heads per KV head) K and V shrink G times, the\n"
      "  ratio falls to cp/(G+1), and Ulysses needs cp <= KV heads. Llama 3 405B (128 query\n"
      "  heads, 8 KV, G = 16) at cp 8: the all-gather sends less than Ulysses.\n");
}

void print_memory(std::ostream& out, const CpConfig& c, const Mesh& mesh, int64_t predicted,
                  int64_t per_layer, const std::vector<int64_t>& measured) {
  const GptConfig& m = c.run.model;
  const int64_t e = c.run.precision == Precision::kFp32 ? 4 : 2;
  const int64_t rows = c.run.batch / mesh.size("dp_replicate");
  fmt::print(out, "\nActivations one forward keeps for backward, per rank (counting allocator):\n");
  if (measured.empty()) {
    fmt::print(out, "  (not measured on {}: the counting allocator sees the CPU)\n", "this device");
  } else {
    std::string row;
    for (size_t r = 0; r < measured.size(); ++r) {
      row += fmt::format("{}{}", r == 0 ? "" : ", ", with_commas(measured[r]));
    }
    fmt::print(out, "  measured  {} bytes (ranks 0..{})\n", row, measured.size() - 1);
  }
  if (predicted >= 0) {
    fmt::print(out, "  predicted {} bytes ({} layers, README section 6)\n", with_commas(predicted),
               m.layers);
  }
  fmt::print(out, "  predicted per layer {} bytes{}\n", with_commas(per_layer),
             mesh.size("tp") == 1 ? std::string()
             : c.sequence_parallel
                 ? std::string(" (tp: every term / tp, sequence parallelism)")
                 : std::string(" (tp: the LayerNorm regions whole on each TP rank)"));
  fmt::print(out, "  one rank, whole sequence: ");
  for (Attention kind : {Attention::kRing, Attention::kAllGather, Attention::kUlysses}) {
    fmt::print(out, "{} {}{}", attention_name(kind),
               with_commas(predict_activation_bytes(kind, m.layers, rows, m.ctx, m.hidden, m.heads,
                                                    m.vocab, 1, e)),
               kind == Attention::kUlysses ? "\n" : ", ");
  }
}

int run(const TrainOptions& t, const Options& o, std::ostream& out, std::ostream& err) {
  // 1. Configuration, checked on every rank before the network is touched.
  CpConfig c;
  c.run = t.run_config();
  c.attention = parse_attention(o.attention);
  c.zigzag = o.zigzag;
  Job job = Job::prepare(t.train.backend, std::chrono::seconds(t.timeout_s));
  c.sequence_parallel = o.sequence_parallel;
  const Mesh mesh = make_mesh(job.env.world_size, o.dp, o.cp, o.tp);
  check_config(c, mesh.size("dp_replicate"), mesh.size("cp"), mesh.size("tp"));

  // 2. Build: the counting allocator (CPU: each rank's activations), the process group, then
  // this rank's TP, CP and replica groups.
  if (job.device.is_cpu()) install_counting_allocator();
  job.trace_dir = t.trace;  // --trace DIR: a timeline of every rank
  job.connect();
  Groups groups =
      make_groups(job.store, mesh, job.rank(), job.backend, job.timeout, job.env.master_addr);
  // with --trace, on the timeline by group, each span with its group's global ranks
  groups.tp = job.traced(groups.tp, "tp", mesh.group(job.rank(), {"tp"}));
  groups.cp = job.traced(groups.cp, "cp", mesh.group(job.rank(), {"cp"}));
  groups.replicas =
      job.traced(groups.replicas, "replicas", mesh.group(job.rank(), {"dp_replicate", "cp"}));
  c10::intrusive_ptr<Comm> cp = groups.cp;
  if (o.no_overlap) cp = c10::make_intrusive<WaitingComm>(cp);
  Comm* tp = mesh.size("tp") > 1 ? groups.tp.get() : nullptr;
  const bool talk = job.rank0() && !t.train.json;
  if (talk) {
    const int64_t tl = c.run.model.ctx / mesh.size("cp");
    print_banner(
        out, "Lesson 10: context parallelism", job, c.run.model,
        count_parameters(*Gpt(c.run.model)),
        {{"grid",
          fmt::format("{} ranks = tp {} x cp {} x dp {} (tp fastest, then cp){}", mesh.world(),
                      mesh.size("tp"), mesh.size("cp"), mesh.size("dp_replicate"),
                      mesh.size("tp") == 1  ? std::string()
                      : c.sequence_parallel ? std::string(", sequence parallel over tp")
                                            : std::string(", no sequence parallelism"))},
         {"split",
          fmt::format("each rank: {} of {} tokens a sequence{}, {} attention", tl, c.run.model.ctx,
                      c.zigzag ? fmt::format(" (zig-zag: chunks r and {}-r of {})",
                                             2 * mesh.size("cp") - 1, 2 * mesh.size("cp"))
                               : std::string(" (contiguous)"),
                      attention_name(c.attention))},
         {"train", fmt::format("AdamW lr {:g}, {} steps, global batch {} ({} per replica), seed {}",
                               c.run.lr, t.train.steps, c.run.batch,
                               c.run.batch / mesh.size("dp_replicate"), c.run.seed)},
         {"numerics", c.run.precision == Precision::kFp32
                          ? std::string("precision fp32, recompute none")
                          : fmt::format("precision {} (fp32 master weights), recompute none",
                                        precision_name(c.run.precision))}});
  }

  // 3. The loop (train_cp), one progress line per tenth of the run.
  StepLog log(err, talk, 0, t.train.steps, c.run.batch * c.run.model.ctx);
  CpRunOptions run;
  run.steps = t.train.steps;
  run.device = job.device;
  run.on_step = [&](int64_t step, float loss) {
    log.end_step(step, loss);
    log.begin_step();
  };
  run.digest = true;
  const nlohmann::json digest = train_cp(c, *cp, *groups.replicas, tp, run).digest;

  // The activations one forward keeps, on every rank (the counting allocator: CPU only), against
  // the closed form (predict_activation_bytes).
  const int64_t e = c.run.precision == Precision::kFp32 ? 4 : 2;
  const GptConfig& m = c.run.model;
  const int64_t rows = c.run.batch / mesh.size("dp_replicate");
  const int64_t predicted =
      mesh.size("tp") > 1 ? -1
                          : predict_activation_bytes(c.attention, m.layers, rows, m.ctx, m.hidden,
                                                     m.heads, m.vocab, mesh.size("cp"), e);
  const int64_t per_layer =
      predict_layer_activation_bytes(c.attention, rows, m.ctx, m.hidden, m.heads, mesh.size("cp"),
                                     e, mesh.size("tp"), c.sequence_parallel);
  std::vector<int64_t> measured;
  if (job.device.is_cpu()) {
    Gpt fresh = make_gpt(m, c.run.seed, job.device);
    CpGpt model{nullptr};
    TpCpGpt split{nullptr};
    if (tp == nullptr) {
      model = CpGpt(fresh, *cp, c.attention, c.zigzag);
    } else {
      split = TpCpGpt(fresh, *tp, *cp, c.attention, c.zigzag, c.sequence_parallel);
      fresh = Gpt(nullptr);
    }
    MasterAdamW cast(tp == nullptr ? static_cast<torch::nn::Module&>(*model->gpt)
                                   : static_cast<torch::nn::Module&>(*split->model),
                     c.run.precision, adamw_options(c.run));  // bf16: the model in bf16
    const Batch batch = ByteDataset::builtin().batch(c.run.seed, 0, rows, m.ctx,
                                                     mesh.coord(job.rank(), "dp_replicate") * rows);
    Batch mine;
    mine.inputs = shard_sequence(batch.inputs, cp->getRank(), mesh.size("cp"), c.zigzag);
    mine.targets = shard_sequence(batch.targets, cp->getRank(), mesh.size("cp"), c.zigzag);
    torch::Tensor all = torch::zeros({mesh.world()}, torch::kLong);
    all[job.rank()] = tp == nullptr ? measure_activation_bytes(model, mine)
                                    : measure_activation_bytes(split, mine);
    std::vector<torch::Tensor> t{all};
    job.comm->allreduce(t)->wait();
    for (int r = 0; r < mesh.world(); ++r) measured.push_back(all[r].item<int64_t>());
  }

  // 4. Report, 5. finish.
  job.finish();
  if (!job.rank0()) return kExitOk;
  if (t.train.json) {
    const double e = c.run.precision == Precision::kFp32 ? 4 : 2;
    const AttentionVolume v =
        attention_volume(c.attention, c.run.batch / mesh.size("dp_replicate"), c.run.model.ctx,
                         c.run.model.hidden, mesh.size("cp"));
    nlohmann::json j = run_json(log, t.train.steps, job.device);
    add_job_json(j, job, c.run, Recompute::kNone, digest);
    j["dp"] = mesh.size("dp_replicate");
    j["cp"] = mesh.size("cp");
    j["tp"] = mesh.size("tp");
    j["sequence_parallel"] = c.sequence_parallel;
    j["attention"] = attention_name(c.attention);
    j["zigzag"] = c.zigzag;
    j["overlap"] = !o.no_overlap;
    j["comm_per_layer"] = {{"forward_elements", v.forward},
                           {"backward_elements", v.backward},
                           {"backward_fp32_elements", v.backward_fp32},
                           {"bytes_per_element", e},
                           {"bytes", (v.forward + v.backward) * e + v.backward_fp32 * 4}};
    j["activation_bytes"] = {
        {"predicted", predicted < 0 ? nlohmann::json(nullptr) : nlohmann::json(predicted)},
        {"predicted_per_layer", per_layer},
        {"measured", measured.empty() ? nlohmann::json(nullptr) : nlohmann::json(measured)}};
    print_json_line(out, j);
    return kExitOk;
  }
  print_report(out, c, mesh, log);
  print_memory(out, c, mesh, predicted, per_layer, measured);
  return kExitOk;
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  TrainCli cli(
      "lesson10",
      "Lesson 10: context parallelism. Trains the course's GPT with each sequence split over\n"
      "--cp ranks and the batch over --dp replicas; run it under torchrun, e.g.\n"
      "  torchrun --standalone --nproc_per_node=2 --no_python build/bin/lesson10");
  cli.add_timeout_flag();
  cli.add_precision_flag({Precision::kFp32, Precision::kBf16});
  Options o;
  CLI::App& app = cli.app();
  app.add_option("--cp", o.cp,
                 "ranks that split each sequence (default: world size / dp; with neither flag, "
                 "the world size)")
      ->check(positive_count("--cp 2"));
  app.add_option("--dp", o.dp, "data-parallel replicas (default: world size / (tp cp))")
      ->check(positive_count("--dp 2"));
  app.add_option("--tp", o.tp,
                 "tensor-parallel ranks that split each layer's weights (lesson 08; default 1)")
      ->check(positive_count("--tp 2"));
  app.add_flag("--sequence-parallel", o.sequence_parallel,
               "with --tp: split the LayerNorm and residual regions along the sequence over the "
               "TP ranks too (Megatron's sequence parallelism)");
  app.add_option("--attention", o.attention,
                 "ring (K/V rotate, overlapped), ulysses (all-to-all to heads) or allgather "
                 "(every rank gathers K and V)")
      ->check(one_of({"ring", "ulysses", "allgather"}, "a context-parallel attention"))
      ->capture_default_str();
  app.add_flag("--zigzag", o.zigzag,
               "split each sequence into 2 cp chunks, rank r holding chunks r and 2cp-1-r, so "
               "that the causal ring gives every rank the same work (allgather accepts it too, "
               "but computes every rank's dense scores whatever the split)");
  app.add_flag("--no-overlap", o.no_overlap,
               "complete each hop before computing (a communicator that waits in every receive): "
               "the ring without overlap, to measure what the overlap is worth");
  return cli.run(argc, argv, err, [&] { return run(cli.options(), o, out, err); });
}

int run_main(int argc, char** argv) { return run_program(argc, argv, std::cout, std::cerr); }

}  // namespace dtc::l10
