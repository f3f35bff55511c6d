// The lesson09 program: trains the course's GPT cut into one pipeline stage per rank (with
// --stages S on S x R ranks, R such pipelines side by side, data parallel), then measures the
// pipeline bubble of each schedule for several micro-batch counts and their activation memory.
// Given in full; the split, the schedules, send/recv and the executor are yours, in
// pipeline.cpp.
//
//   torchrun --standalone --nproc_per_node=4 --no_python build/bin/lesson09 --micro-batches 4
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <ostream>

#include "dtc/cli.h"
#include "dtc/digest.h"
#include "dtc/dist.h"
#include "dtc/errors.h"
#include "dtc/memory.h"
#include "dtc/mesh.h"
#include "dtc/program.h"

namespace dtc::l09 {
namespace {

GptConfig untied(GptConfig c) {
  c.tied = false;
  return c;
}

// This rank's model chunks (one, or v interleaved), from the baseline's initial weights, on
// options.device.
std::vector<Stage> build_chunks(const PipelineOptions& o, int stages, int rank) {
  Gpt full = make_gpt(untied(o.model), o.seed, o.device);  // every rank builds it all
  return make_chunks(full, stages, o.chunks, rank);  // the other modules are freed with `full`
}

// What a schedule needs of the run, checked on every rank before anything is built.
void check_schedule(const PipelineOptions& o, int stages) {
  if (o.schedule == ScheduleKind::kInterleaved && stages >= 1) {
    check_interleaved(o.model, stages, o.chunks, o.micro_batches);  // names --virtual-stages
  }
  check_pipeline(o.model, stages * o.chunks, o.batch, o.micro_batches);
  if (o.replicas > 1 && o.batch % (int64_t{o.replicas} * o.micro_batches) != 0) {
    throw UsageError("--micro-batches",
                     fmt::format("{} replicas of {} micro-batches each do not divide the batch of "
                                 "{} sequences",
                                 o.replicas, o.micro_batches, o.batch),
                     fmt::format("pass a --global-batch that is a multiple of {} (replicas x "
                                 "micro-batches), or fewer --micro-batches",
                                 int64_t{o.replicas} * o.micro_batches));
  }
  if (o.schedule != ScheduleKind::kInterleaved && o.chunks != 1) {
    throw UsageError("--virtual-stages",
                     fmt::format("{} model chunks per rank with the {} schedule", o.chunks,
                                 schedule_name(o.schedule)),
                     "pass --schedule interleaved, or leave --virtual-stages out");
  }
  if (o.schedule == ScheduleKind::kZbH1 && o.recompute != Recompute::kNone) {
    throw UsageError("--recompute", "zb-h1 with recomputation",
                     "leave --recompute out: W needs the graph that I kept");
  }
  if (o.schedule == ScheduleKind::kZbH1 && o.deallocate_outputs) {
    throw UsageError("--deallocate-outputs", "zb-h1 with deallocated outputs",
                     "leave --deallocate-outputs out: W runs from the output's graph");
  }
}

void zero_grads(const std::vector<torch::Tensor>& params) {
  for (auto p : params) p.mutable_grad().reset();  // to none, as lesson 02's zero_grad_to_none
}

// Sums a per-stage value over the ranks: every rank writes its own slot.
std::vector<double> gather_per_stage(Comm& comm, double value, const torch::Device& device) {
  auto t = torch::zeros({comm.getSize()}, torch::dtype(torch::kDouble).device(device));
  t[comm.getRank()] = value;
  std::vector<at::Tensor> v{t};
  comm.allreduce(v)->wait();
  auto cpu = t.cpu();
  return std::vector<double>(cpu.data_ptr<double>(), cpu.data_ptr<double>() + cpu.numel());
}

// The ideal time of a step in units of (the bubble's (p - 1) slots): m, v m for interleaved
// (each slot 1/v of a stage's work), 3 m for ZB-H1 (F, B and W of equal length, one of the
// three in each of the p - 1 slots is filled).
double ideal_units(const BubbleRow& r) {
  const auto m = static_cast<double>(r.micro_batches);
  if (r.schedule == ScheduleKind::kInterleaved) return static_cast<double>(r.chunks) * m;
  if (r.schedule == ScheduleKind::kZbH1) return 3 * m;
  return m;
}
}  // namespace

double BubbleRow::theory() const {
  const auto p = static_cast<double>(stages);
  return (p - 1) / (ideal_units(*this) + p - 1);
}

double BubbleRow::theory_per_compute() const {
  const auto p = static_cast<double>(stages);
  return (p - 1) / ideal_units(*this);
}

double BubbleRow::mean_bubble() const {
  double sum = 0;
  for (double b : bubble) sum += b;
  return bubble.empty() ? 0.0 : sum / static_cast<double>(bubble.size());
}

PipelineGroups pipeline_groups(const c10::intrusive_ptr<c10d::Store>& store, int world, int rank,
                               int stages, BackendKind backend, std::chrono::milliseconds timeout,
                               const std::string& master_addr) {
  if (stages < 1 || world % stages != 0) {
    throw UsageError(
        "--stages",
        fmt::format("{} stages on {} ranks: the ranks must be stages x replicas", stages, world),
        fmt::format("pass a --stages that divides {}, or start a multiple of {} ranks", world,
                    stages));
  }
  const Mesh mesh =
      Mesh::build(world, {{"pp", stages, "--stages"}, {"dp_replicate", 0, "--stages"}});
  const MeshGroups groups(store, mesh, rank, {{"pp"}, {"dp_replicate"}}, backend, timeout,
                          master_addr);
  return PipelineGroups{groups.get({"pp"}), groups.get({"dp_replicate"})};
}

PipelineResult train_pipeline(const PipelineOptions& o, Comm& comm, StepLog* log, Comm* replicas) {
  const int p = comm.getSize();
  const int s = comm.getRank();
  const int dp = replicas != nullptr ? replicas->getSize() : 1;
  if (dp != o.replicas) {
    throw std::invalid_argument(fmt::format(
        "train_pipeline: options.replicas is {} but the replicas' communicator has {} ranks",
        o.replicas, dp));
  }
  const int64_t rows = o.batch / dp;  // this replica's share of each batch
  const int64_t first_row = (replicas != nullptr ? replicas->getRank() : 0) * rows;
  check_schedule(o, p);
  check_precision(o.precision, /*bf16_collectives=*/false);  // fp32 messages
  std::vector<Stage> chunks = build_chunks(o, p, s);
  const auto params = parameters_of(chunks);
  // AdamW per stage over its own parameters: elementwise, so p optimizers = the baseline's one.
  // bf16: over fp32 master weights, the stage's parameters cast to bf16 (dtc::MasterAdamW).
  MasterAdamW optimizer(params, o.precision, adamw_options(o));
  for (auto& c : chunks) c.precision = o.precision;
  const auto ops = make_schedule(o.schedule, p, o.micro_batches, s, o.chunks);
  const ByteDataset data = ByteDataset::builtin();
  // On NCCL, a group of sends and receives (dtc::batch_isend_irecv) runs on the communicator of
  // the whole group, which the group's first collective creates with every rank taking part;
  // under GPipe the last stage never starts such a group, so create it here, as PyTorch's
  // pipelining does before its first step (an allreduce of one element over the stages).
  std::vector<at::Tensor> one{torch::ones({1}, torch::dtype(torch::kFloat).device(o.device))};
  comm.allreduce(one)->wait();
  PipelineResult result;
  std::vector<float>& losses = result.losses;
  for (int64_t step = 0; step < o.steps; ++step) {
    if (log) log->begin_step();
    Batch batch = data.batch(o.seed, step, o.batch, o.model.ctx).to(o.device);
    if (dp > 1) {
      batch.inputs = batch.inputs.narrow(0, first_row, rows);
      batch.targets = batch.targets.narrow(0, first_row, rows);
    }
    optimizer.zero_grad();
    // A trace's labels F0, B0, ... start again; with replicas, each chunk's average starts
    // when its last backward pass is done.
    ReplicaAverage average(chunks, replicas, o.micro_batches);
    const StepStats stats = run_schedule(chunks, comm, ops, batch, o.micro_batches,
                                         o.deallocate_outputs, o.recompute == Recompute::kFull);
    average.finish();
    optimizer.step();
    // The loss lives on the last stage: a sum in which only it writes a non-zero; then the
    // replicas' mean.
    auto loss = torch::full({1}, chunks.back().layers.head ? stats.loss : 0.0f,
                            torch::dtype(torch::kFloat).device(o.device));
    std::vector<at::Tensor> v{loss};
    comm.allreduce(v)->wait();
    if (dp > 1) {
      replicas->allreduce(v)->wait();
      loss.div_(dp);
    }
    losses.push_back(loss.cpu().item<float>());
    if (log) log->end_step(step, losses.back());
  }
  if (o.digest) {
    std::vector<std::string> names;
    for (const auto& item : Gpt(untied(o.model))->named_parameters()) names.push_back(item.key());
    std::vector<NamedPiece> pieces;  // in parameters_of() order
    for (const auto& c : chunks) {
      const auto mine = stage_pieces(c);
      pieces.insert(pieces.end(), mine.begin(), mine.end());
    }
    for (size_t i = 0; i < pieces.size(); ++i) pieces[i].second = optimizer.master()[i];
    result.digest = param_digest(names, pieces, &comm);
  }
  if (o.weights) {
    for (const auto& w : optimizer.master()) result.weights.push_back(w.detach().clone());
  }
  return result;
}

std::vector<BubbleRow> measure_bubbles(const PipelineOptions& o, Comm& comm) {
  const int p = comm.getSize();
  const int s = comm.getRank();
  const ByteDataset data = ByteDataset::builtin();
  const Batch batch = data.batch(o.seed, 0, o.batch, o.model.ctx).to(o.device);
  // Every schedule the run allows: GPipe and 1F1B; interleaved with the run's v (2 if the run's
  // is not interleaved) where the layers split so; ZB-H1 unless the run recomputes or
  // deallocates outputs. Each (schedule, m) on its own chunks, in the run's dtype.
  struct Sweep {
    ScheduleKind kind;
    int chunks;
  };
  std::vector<Sweep> kinds{{ScheduleKind::kGpipe, 1}, {ScheduleKind::k1f1b, 1}};
  const int v = o.schedule == ScheduleKind::kInterleaved ? o.chunks : 2;
  if (o.model.layers % (static_cast<int64_t>(p) * v) == 0 && p > 1) {
    kinds.push_back({ScheduleKind::kInterleaved, v});
  }
  if (o.recompute == Recompute::kNone && !o.deallocate_outputs) {
    kinds.push_back({ScheduleKind::kZbH1, 1});
  }
  std::vector<BubbleRow> rows;
  for (const Sweep& sweep : kinds) {
    PipelineOptions ko = o;
    ko.schedule = sweep.kind;
    ko.chunks = sweep.chunks;
    std::vector<Stage> chunks = build_chunks(ko, p, s);
    const auto params = parameters_of(chunks);
    if (o.precision != Precision::kFp32) {
      torch::NoGradGuard no_grad;  // the run's dtype (no optimizer here: nothing steps)
      for (auto t : params) t.set_data(t.detach().to(working_dtype(o.precision)));
      for (auto& c : chunks) c.precision = o.precision;
    }
    const ScheduleKind kind = sweep.kind;
    for (int64_t m : o.sweep) {
      if (m < 1 || o.batch % m != 0) continue;
      if (kind == ScheduleKind::kInterleaved && m % p != 0) continue;
      const auto ops = make_schedule(kind, p, m, s, sweep.chunks);
      const auto steps = static_cast<size_t>(std::max<int64_t>(1, o.sweep_steps));
      std::vector<double> windows(steps), computes(steps);
      int64_t in_flight = 0, peak = -1;
      for (size_t k = 0; k < steps; ++k) {
        zero_grads(params);
        int64_t before = 0;
        if (counting_allocator_installed()) {
          before = cpu_memory().current;
          reset_cpu_peak();
        }
        // One window for every stage: it opens when all have passed the first barrier and closes
        // when the last stage's last op is done. A stage's own end would hide its idle tail:
        // stage 0 finishes last, the last stage first, so only stage 0 would see the formula.
        comm.barrier()->wait();
        const auto t0 = std::chrono::steady_clock::now();
        for (auto& c : chunks) c.begin_step();
        const StepStats st = run_schedule(chunks, comm, ops, batch, m, o.deallocate_outputs,
                                          o.recompute == Recompute::kFull);
        comm.barrier()->wait();
        windows[k] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        computes[k] = st.compute_s;
        if (counting_allocator_installed()) peak = std::max(peak, cpu_memory().peak - before);
        in_flight = st.max_in_flight;
      }
      // The best step, the same one for every stage: the shortest window, as the slowest stage saw
      // it (an allreduce MAX of each step's window).
      std::vector<at::Tensor> w{torch::tensor(windows, torch::kDouble).to(o.device)};
      comm.allreduce(w, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
      const auto common = w[0].cpu();
      size_t best = 0;
      for (size_t k = 1; k < steps; ++k)
        if (common[k].item<double>() < common[best].item<double>()) best = k;
      const double window = common[best].item<double>();
      const double idle = std::max(0.0, window - computes[best]);
      zero_grads(params);
      BubbleRow row;
      row.schedule = kind;
      row.micro_batches = m;
      row.stages = p;
      row.chunks = sweep.chunks;
      row.bubble = gather_per_stage(comm, window > 0 ? idle / window : 0.0, o.device);
      row.idle_per_compute =
          gather_per_stage(comm, computes[best] > 0 ? idle / computes[best] : 0.0, o.device);
      if (!o.device.is_cpu()) {
        // CUDA kernels run after the CPU has moved on: the executor's clock around them times
        // their launch, not their work, so idle / window would be meaningless.
        row.bubble.clear();
        row.idle_per_compute.clear();
      }
      for (double v : gather_per_stage(comm, static_cast<double>(in_flight), o.device))
        row.in_flight.push_back(static_cast<int64_t>(v));
      for (double v : gather_per_stage(comm, static_cast<double>(peak), o.device))
        row.peak_bytes.push_back(static_cast<int64_t>(v));
      rows.push_back(row);
    }
  }
  return rows;
}

std::vector<std::pair<std::string, std::string>> stage_rows(const PipelineOptions& o, int p) {
  std::vector<std::pair<std::string, std::string>> rows = {
      {"train", fmt::format("AdamW lr {:g}, {} steps, {} schedule, {} micro-batches of {} "
                            "sequences{}, seed {}",
                            o.lr, o.steps, schedule_name(o.schedule), o.micro_batches,
                            o.batch / o.micro_batches / o.replicas,
                            o.replicas > 1 ? fmt::format(" on each of {} replicas", o.replicas)
                                           : std::string(),
                            o.seed)},
      {"numerics",
       fmt::format("precision {}, recompute {}",
                   o.precision == Precision::kFp32
                       ? std::string("fp32")
                       : fmt::format("{} (fp32 master weights, fp32 messages between "
                                     "stages)",
                                     precision_name(o.precision)),
                   o.recompute == Recompute::kFull ? "full (each stage's layers again in backward)"
                                                   : "none")}};
  for (int s = 0; s < p; ++s) {
    std::string blocks;  // the rank's chunks: virtual stages s, p + s, ...
    bool embed = false, head = false;
    for (int c = 0; c < o.chunks; ++c) {
      const StageLayers l = stage_layers(o.model.layers, p * o.chunks, c * p + s);
      blocks += fmt::format("{}[{}, {})", blocks.empty() ? "" : " ", l.first, l.last);
      embed = embed || l.embed;
      head = head || l.head;
    }
    rows.emplace_back(
        fmt::format("stage {}", s),
        fmt::format("({}): blocks {}{}{}   schedule {}",
                    o.replicas > 1 ? fmt::format("ranks {}-{}, one per replica", s * o.replicas,
                                                 (s + 1) * o.replicas - 1)
                                   : fmt::format("rank {}", s),
                    blocks, embed ? " + embeddings" : "", head ? " + ln_f, lm_head, loss" : "",
                    to_string(make_schedule(o.schedule, p, o.micro_batches, s, o.chunks))));
  }
  return rows;
}

int run_pipeline(const PipelineOptions& o, Comm& comm, std::ostream& out, std::ostream& err,
                 Comm* replicas) {
  const int p = comm.getSize();
  // The job's rank (the mesh's order: a stage's replicas are neighbours).
  const int rank = (replicas != nullptr ? replicas->getRank() : 0) + o.replicas * comm.getRank();
  check_schedule(o, p);
  StepLog log(err, rank == 0 && !o.json, 0, o.steps, o.batch * o.model.ctx);
  PipelineOptions run = o;
  run.digest = true;
  const PipelineResult result = train_pipeline(run, comm, &log, replicas);
  const std::vector<BubbleRow> rows = measure_bubbles(o, comm);  // each replica its own
  if (rank != 0) return kExitOk;

  if (o.json) {
    nlohmann::json j = run_json(log, o.steps, o.device);
    j["param_digest"] = result.digest;
    j["step_s"] = log.step_seconds();  // rank 0's wall time of every step (the first warms up)
    j["stages"] = p;
    j["replicas"] = o.replicas;
    j["micro_batches"] = o.micro_batches;
    j["schedule"] = schedule_name(o.schedule);
    j["virtual_stages"] = o.chunks;
    j["precision"] = precision_name(o.precision);
    j["recompute"] = recompute_name(o.recompute);
    j["torch"] = torch_version();
    nlohmann::json layers = nlohmann::json::array();
    for (int s = 0; s < p * o.chunks; ++s) {  // virtual stage s is rank s % p's chunk s / p
      const StageLayers l = stage_layers(o.model.layers, p * o.chunks, s);
      layers.push_back({l.first, l.last});
    }
    j["stage_blocks"] = layers;
    j["bubble"] = nlohmann::json::array();
    for (const auto& r : rows) {
      j["bubble"].push_back(
          {{"schedule", schedule_name(r.schedule)},
           {"virtual_stages", r.chunks},
           {"micro_batches", r.micro_batches},
           {"measured", r.bubble.empty() ? nlohmann::json() : nlohmann::json(r.bubble)},
           {"mean", r.bubble.empty() ? nlohmann::json() : nlohmann::json(r.mean_bubble())},
           {"theory", r.theory()},
           {"idle_per_compute",
            r.idle_per_compute.empty() ? nlohmann::json() : nlohmann::json(r.idle_per_compute)},
           {"theory_per_compute", r.theory_per_compute()},
           {"in_flight", r.in_flight},
           {"peak_bytes", r.peak_bytes}});
    }
    j["config"] = config_json(o.model, o.batch, o.seed, o.lr);
    print_json_line(out, j);
    return kExitOk;
  }

  fmt::print(out, "\n  trained {} steps: loss {:.4f} -> {:.4f}, {:.0f} tokens/s, {:.2f} s\n",
             o.steps, result.losses.empty() ? 0.0f : result.losses.front(),
             result.losses.empty() ? 0.0f : result.losses.back(), log.tokens_per_s(),
             log.elapsed_s());
  if (rows.empty()) return kExitOk;
  fmt::print(out,
             "\nThe bubble: idle time of one forward-backward step per stage, in one window for "
             "all stages\n(barrier to barrier, the best of {} steps); idle / window against "
             "(p-1)/(m+p-1), and idle / compute\nagainst Megatron-LM's (p-1)/m{}:\n\n",
             o.sweep_steps,
             o.device.is_cpu() ? ""
                               : " (not measured on CUDA: a CPU clock around asynchronous "
                                 "kernels\ntimes their launch, not their work)");
  fmt::print(out, "  {:<11} {:>3}  {:>8} {:>8}  {:<23} {:>9}  {}\n", "schedule", "m", "theory",
             "mean", "idle/window per stage", "(p-1)/m", "idle/compute per stage");
  for (const auto& r : rows) {
    std::vector<std::string> per, per_compute;
    for (double b : r.bubble) per.push_back(fmt::format("{:.2f}", b));
    for (double b : r.idle_per_compute) per_compute.push_back(fmt::format("{:.2f}", b));
    const std::string mean = r.bubble.empty() ? "-" : fmt::format("{:.3f}", r.mean_bubble());
    fmt::print(out, "  {:<11} {:>3}  {:>8.3f} {:>8}  {:<23} {:>9.3f}  {}\n",
               schedule_name(r.schedule), r.micro_batches, r.theory(), mean,
               fmt::format("{}", fmt::join(per, " ")), r.theory_per_compute(),
               fmt::join(per_compute, " "));
  }
  fmt::print(out,
             "\nActivation memory per stage: micro-batches stored at once (GPipe m, 1F1B "
             "min(m, p-s)),\nand the counting allocator's peak during the step (MiB; '-' "
             "when not measured):\n\n");
  fmt::print(out, "  {:<11} {:>3}  {:<22} {}\n", "schedule", "m", "in flight per stage",
             "peak MiB per stage");
  for (const auto& r : rows) {
    std::vector<std::string> mib;
    for (int64_t b : r.peak_bytes)
      mib.push_back(b < 0 ? "-" : fmt::format("{:.2f}", static_cast<double>(b) / (1 << 20)));
    fmt::print(out, "  {:<11} {:>3}  {:<22} {}\n", schedule_name(r.schedule), r.micro_batches,
               fmt::format("{}", fmt::join(r.in_flight, " ")), fmt::join(mib, " "));
  }
  return kExitOk;
}

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
                const EnvLookup& env_lookup) {
  TrainCli cli(
      "lesson09",
      "Lesson 09: pipeline parallelism. Trains the course's GPT (untied head) cut into one "
      "stage per rank with GPipe, 1F1B, interleaved 1F1B or ZB-H1 over micro-batches (--stages "
      "S on S x R ranks: R pipelines side by side, data parallel), then measures the bubble "
      "and the activation memory. Start it with torchrun (one process per stage).",
      /*default_steps=*/20, /*untied_flag=*/false);  // always untied: no --untied
  cli.add_timeout_flag();
  cli.add_precision_flag({Precision::kFp32, Precision::kBf16});
  cli.add_recompute_flag({Recompute::kNone, Recompute::kFull});
  PipelineOptions o;
  int stages = 0;
  int virtual_stages = 0;
  std::string schedule = "1f1b";
  bool no_sweep = false;
  CLI::App& app = cli.app();
  app.add_option("--stages", stages,
                 "pipeline stages S (default: the world size); S x replicas ranks run replicas "
                 "pipelines side by side, data parallel")
      ->check(positive_count("--stages 4"));
  app.add_option("--micro-batches", o.micro_batches, "micro-batches m per step (divides the batch)")
      ->check(positive_count("--micro-batches 4"))
      ->capture_default_str();
  app.add_option("--schedule", schedule, "gpipe, 1f1b, interleaved or zb-h1")
      ->check(one_of({"gpipe", "1f1b", "interleaved", "zb-h1"}, "a pipeline schedule"))
      ->capture_default_str();
  app.add_option("--virtual-stages", virtual_stages,
                 "v, model chunks per rank for --schedule interleaved (default 2)")
      ->check(positive_count("--virtual-stages 2"));
  app.add_option("--sweep", o.sweep,
                 "micro-batch counts for the bubble measurement (those that divide the batch)")
      ->check(positive_count("--sweep 1 2 4 8"))
      ->capture_default_str();
  app.add_flag("--no-sweep", no_sweep, "skip the bubble and memory measurement");
  app.add_flag("--deallocate-outputs", o.deallocate_outputs,
               "free each sent output's values, keeping its graph (Megatron's "
               "deallocate_output_tensor)");
  app.add_option("--sweep-steps", o.sweep_steps, "timed steps per (schedule, m)")
      ->check(positive_count("--sweep-steps 3"))
      ->capture_default_str();
  return cli.run(argc, argv, err, [&] {
    // 1. Configuration, checked on every rank before the network is touched.
    const TrainOptions& t = cli.options();
    Job job = Job::prepare(t.train.backend, std::chrono::seconds(t.timeout_s), env_lookup);
    static_cast<RunConfig&>(o) = t.run_config();
    o.model.tied = false;  // the pipeline's last stage has its own head
    o.steps = t.train.steps;
    o.json = t.train.json;
    o.schedule = parse_schedule(schedule);
    o.chunks =
        virtual_stages > 0 ? virtual_stages : (o.schedule == ScheduleKind::kInterleaved ? 2 : 1);
    o.device = job.device;
    check_precision(o.precision, /*bf16_collectives=*/false);  // fp32 messages
    if (no_sweep) o.sweep.clear();
    const int world = job.env.world_size;
    if (stages == 0) stages = world;
    // More ranks than the default 4 layers (e.g. 8 GPUs) and no --layers: one block each.
    if (app.count("--layers") == 0 && stages * o.chunks > o.model.layers) {
      o.model.layers = stages * o.chunks;
    }
    if (world % stages != 0) {
      throw UsageError(
          "--stages",
          fmt::format("{} stages on {} ranks: the ranks must be stages x replicas", stages, world),
          fmt::format("start a multiple of {} ranks (torchrun --nproc_per_node={}), pass a "
                      "--stages that divides {}, or leave --stages out (one pipeline)",
                      stages, 2 * stages, world));
    }
    o.replicas = world / stages;
    check_schedule(o, stages);

    // 2. Build: the counting allocator on the CPU (each stage's activation peak), the group.
    if (job.device.is_cpu()) install_counting_allocator();
    job.trace_dir = t.trace;  // --trace DIR: a timeline of every rank
    job.connect();
    PipelineGroups groups{job.comm, {}};  // one pipeline: the world
    if (o.replicas > 1) {
      groups = pipeline_groups(job.store, world, job.rank(), stages, job.backend, job.timeout,
                               job.env.master_addr);
    }
    if (job.rank0() && !o.json) {
      print_banner(
          out,
          o.replicas > 1
              ? fmt::format("Lesson 09: pipeline parallelism, {} stages x {} replicas "
                            "(data parallel over pipelines)",
                            stages, o.replicas)
              : fmt::format("Lesson 09: pipeline parallelism, {} stages (one per rank)", world),
          job, o.model, count_parameters(*Gpt(o.model)), stage_rows(o, stages));
    }

    // 3. The loop and 4. the report (run_pipeline), 5. finish.
    const int code = run_pipeline(o, *groups.pipeline, out, err, groups.replicas.get());
    job.finish();
    return code;
  });
}

int run_main(int argc, char** argv) { return run_program(argc, argv, std::cout, std::cerr); }

}  // namespace dtc::l09
