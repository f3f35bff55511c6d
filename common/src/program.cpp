// The training programs' skeleton (dtc/program.h).
#include "dtc/program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <ostream>

#include "dtc/errors.h"
#include "dtc/format.h"
#include "dtc/memory.h"
#include "dtc/model_flags.h"

namespace dtc {

// ---------------------------------------------------------------------------------------------
// 1. Configuration
// ---------------------------------------------------------------------------------------------

GptConfig TrainOptions::model_config() const {
  GptConfig c = model;
  c.tied = !untied;
  validate(c);
  return c;
}

RunConfig TrainOptions::run_config() const {
  RunConfig c;
  c.model = model_config();
  c.batch = train.global_batch;
  c.seed = train.seed;
  c.lr = lr;
  c.precision = precision;
  c.fp32_grads = grad_dtype == "fp32" && precision != Precision::kFp32;
  c.recompute = recompute;
  return c;
}

TrainCli::TrainCli(std::string name, std::string description, int64_t default_steps,
                   bool untied_flag)
    : app_(std::move(description), std::move(name)) {
  options_.train.steps = default_steps;
  add_train_flags(app_, options_.train);
  add_model_flags(app_, options_.model, options_.lr, untied_flag ? &options_.untied : nullptr);
  app_.add_option("--trace", options_.trace,
                  "write a timeline of every rank to DIR (rank<r>.json, and trace.json for the "
                  "job: open it in ui.perfetto.dev, or draw it with scripts/trace_svg.py)")
      ->check(writable_directory("pass a directory you can write in, e.g. --trace traces"))
      ->type_name("DIR");
}

void TrainCli::add_timeout_flag() {
  app_.add_option("--timeout-s", options_.timeout_s,
                  "seconds a collective may wait before it fails (a hang becomes an error)")
      ->check(positive_count("--timeout-s 60"))
      ->capture_default_str();
}

void TrainCli::add_precision_flag(const std::vector<Precision>& allowed) {
  // the flags' spellings are the names the --json reports (precision_name, recompute_name)
  std::map<std::string, Precision> precisions;
  for (Precision p : allowed) precisions[precision_name(p)] = p;
  const bool fp16 = precisions.count(precision_name(Precision::kFp16)) > 0;
  app_.add_option("--precision", options_.precision,
                  fp16 ? "fp32, or bf16/fp16 weights and activations with fp32 master weights and "
                         "AdamW state (fp16 with dynamic loss scaling)"
                       : "fp32, or bf16 weights and activations with fp32 master weights and "
                         "AdamW state")
      ->transform(CLI::CheckedTransformer(precisions, CLI::ignore_case))
      ->default_str("fp32");
}

void TrainCli::add_precision_flags() {
  add_precision_flag();
  app_.add_option("--grad-dtype", options_.grad_dtype,
                  "gradients in the working precision (16 bytes/param with AdamW) or in fp32 "
                  "(18 bytes/param); fp32 runs have fp32 gradients either way")
      ->check(CLI::IsMember({"working", "fp32"}))
      ->capture_default_str();
  add_recompute_flag();
}

void TrainCli::add_recompute_flag(const std::vector<Recompute>& allowed) {
  std::map<std::string, Recompute> modes;
  for (Recompute r : allowed) modes[recompute_name(r)] = r;
  const bool selective = modes.count(recompute_name(Recompute::kSelective)) > 0;
  app_.add_option("--recompute", options_.recompute,
                  selective ? "activation recomputation: none, selective (the attention core) or "
                              "full (each block)"
                            : "activation recomputation: none, or full (each stage's layers run "
                              "again in backward)")
      ->transform(CLI::CheckedTransformer(modes, CLI::ignore_case))
      ->default_str("none");
}

int TrainCli::run(int argc, const char* const* argv, std::ostream& err,
                  const std::function<int()>& body) {
  return run_cli(app_, argc, argv, body, err);
}

// ---------------------------------------------------------------------------------------------
// 2. Build
// ---------------------------------------------------------------------------------------------

void check_batch_split(int64_t global_batch, int world, int64_t accum) {
  if (accum < 1) {
    throw UsageError("--accum", fmt::format("{} micro-steps per step", accum),
                     "pass 1 (no accumulation) or more");
  }
  const int64_t parts = world * accum;
  if (global_batch >= 1 && global_batch % parts == 0) return;
  const int64_t lower = std::max<int64_t>(parts, global_batch / parts * parts);
  const std::string split = accum == 1
                                ? fmt::format("over {} ranks", world)
                                : fmt::format("into {} ranks x {} micro-steps", world, accum);
  throw UsageError(
      "--global-batch",
      fmt::format("{} sequences do not split {} of equal size", global_batch, split),
      fmt::format("pass a multiple of {} (e.g. {} or {}); equal shards keep the mean of the "
                  "ranks' mean losses equal to the global mean",
                  parts, lower, lower + parts));
}

int64_t available_memory(const torch::Device& device) {
  if (!device.is_cpu()) return -1;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : -1;
}

void check_fits_in_memory(int64_t need_bytes, const torch::Device& device, const std::string& flag,
                          const std::string& what, const std::string& hint) {
  const int64_t have = available_memory(device);
  if (have < 0 || need_bytes <= have) return;
  throw UsageError(flag,
                   fmt::format("this run needs about {} ({}), and this machine has {} available",
                               human_bytes(static_cast<double>(need_bytes)), what,
                               human_bytes(static_cast<double>(have))),
                   hint);
}

torch::Device rank_device(BackendKind backend, int index, const std::string& variable,
                          std::string hint) {
  if (backend != BackendKind::kNccl) return torch::Device(torch::kCPU);
  const int count = static_cast<int>(torch::cuda::device_count());
  if (count == 0) {
    throw UsageError("--backend", "nccl needs CUDA devices, and this process sees none",
                     "use --backend gloo on a CPU machine");
  }
  // The rank's device is made current, so that its streams, events and NCCL communicator are
  // on it from the start (not on device 0, which every thread starts on).
  if (count == 1) {  // one GPU bound to each task (Slurm)
    const torch::Device device(torch::kCUDA, 0);
    make_current_device(device);
    return device;
  }
  if (index >= count) {
    if (hint.empty()) hint = fmt::format("start at most {} ranks per node", count);
    throw UsageError(
        variable,
        fmt::format("device cuda:{} asked for, but this node has {} GPU(s)", index, count), hint);
  }
  const torch::Device device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  make_current_device(device);
  return device;
}

Job Job::prepare(const std::string& backend, std::chrono::milliseconds timeout,
                 const EnvLookup& lookup) {
  Job job;
  job.backend = parse_backend(backend);
  job.env = read_launch_env(lookup);
  job.timeout = timeout;
  job.device = rank_device(job.backend, job.env.local_rank);
  return job;
}

void Job::connect() {
  if (env.world_size == 1) {
    // One rank needs no store server: a HashStore in this process.
    store = c10::make_intrusive<c10d::HashStore>();
    comm = new_comm(store, 0, 1, backend, timeout);
    if (!trace_dir.empty()) start_trace();
    return;
  }
  DistOptions options;
  options.backend = backend;
  options.timeout = timeout;
  Distributed dist = init_distributed(env, options);
  store = dist.store;
  comm = dist.comm;
  if (!trace_dir.empty()) start_trace();
}

void Job::start_trace() {
  tracer = std::make_shared<Tracer>(rank(), device);
  tracer->set_clock(sync_clock(*store, rank(), world()));
  // Bytes in use on the memory track: the counting allocator (from here on) on the CPU.
  if (!device.is_cuda()) install_counting_allocator();
  comm = c10::make_intrusive<TracingComm>(comm, tracer, "world");
  trace_scope_ = std::make_shared<TraceScope>(tracer.get());
}

c10::intrusive_ptr<Comm> Job::traced(c10::intrusive_ptr<Comm> sub, const std::string& group,
                                     std::vector<int> ranks) const {
  if (!tracer || !sub) return sub;
  return c10::make_intrusive<TracingComm>(std::move(sub), tracer, group, std::move(ranks));
}

Job Job::start(const std::string& backend, std::chrono::milliseconds timeout) {
  Job job = prepare(backend, timeout);
  job.connect();
  return job;
}

void Job::finish() {
  comm->barrier()->wait();
  if (tracer) write_trace(*tracer, store.get(), world(), trace_dir);
}

// ---------------------------------------------------------------------------------------------
// 3. The loop
// ---------------------------------------------------------------------------------------------

StepLog::StepLog(std::ostream& err, bool talk, int64_t first, int64_t steps,
                 int64_t tokens_per_step, std::string prefix)
    : err_(err),
      talk_(talk),
      steps_(steps),
      tokens_per_step_(tokens_per_step),
      every_(std::max<int64_t>(1, (steps - first) / 10)),
      long_run_(steps - first >= kLongRun),
      prefix_(std::move(prefix)),
      start_(std::chrono::steady_clock::now()),
      step_start_(start_),
      end_(start_) {
  // A loop that calls end_step() then begin_step() (lessons 08, 10) times step 0 from here.
  if (Tracer* tracer = active_tracer()) trace_start_ = tracer->now();
}

void StepLog::begin_step() {
  if (Tracer* tracer = active_tracer()) trace_start_ = tracer->now();
  step_start_ = std::chrono::steady_clock::now();
}

void StepLog::end_step(int64_t step, float loss) {
  const auto now = std::chrono::steady_clock::now();
  if (Tracer* tracer = active_tracer()) {
    tracer->span(fmt::format("step {}", step), "step", TraceTrack::kCompute, trace_start_,
                 tracer->now());
  }
  end_ = now;
  step_s_.push_back(std::chrono::duration<double>(now - step_start_).count());
  losses_.push_back(loss);
  const int64_t done = static_cast<int64_t>(losses_.size());
  if (!talk_ || !(done == 1 || (step + 1) % every_ == 0 || step + 1 == steps_)) return;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double rate = static_cast<double>(done * tokens_per_step_) / std::max(elapsed, 1e-9);
  const double left = elapsed / static_cast<double>(done) * static_cast<double>(steps_ - step - 1);
  fmt::print(err_, "{}step {:>{}}/{}  loss {:.4f}  {:>7.1f}k tokens/s{}\n", prefix_, step + 1,
             std::to_string(steps_).size(), steps_, loss, rate / 1000.0,
             long_run_ ? "  ETA " + clock_time(left) : std::string());
  err_.flush();
}

double StepLog::elapsed_s() const { return std::chrono::duration<double>(end_ - start_).count(); }

double StepLog::tokens_per_s() const {
  return static_cast<double>(static_cast<int64_t>(losses_.size()) * tokens_per_step_) /
         std::max(elapsed_s(), 1e-9);
}

double StepLog::median_step_s(size_t warmup) const {
  if (step_s_.size() <= warmup) return median(step_s_);
  return median(
      std::vector<double>(step_s_.begin() + static_cast<std::ptrdiff_t>(warmup), step_s_.end()));
}

void check_resume_step(int64_t first, int64_t steps) {
  if (first < steps) return;
  throw UsageError(
      "--steps",
      fmt::format("the checkpoint is already at step {}, and --steps is {}", first, steps),
      fmt::format("--steps counts from the start: pass more than {}", first));
}

// ---------------------------------------------------------------------------------------------
// 4. The report
// ---------------------------------------------------------------------------------------------

void print_banner(std::ostream& out, const std::string& title, const Job& job,
                  const GptConfig& model, int64_t params,
                  const std::vector<std::pair<std::string, std::string>>& rows) {
  fmt::print(
      out,
      "{}\n"
      "  job     {} rank(s) {}, {} on {}, LibTorch {}\n"
      "  model   GPT, {} layers, hidden {}, {} heads, seq {}, vocab {}, {} head: {} "
      "parameters\n",
      title, job.world(),
      job.env.launcher == Launcher::kNone ? std::string("(no launcher)")
                                          : fmt::format("via {}", launcher_name(job.env.launcher)),
      backend_name(job.backend), job.device.str(), torch_version(), model.layers, model.hidden,
      model.heads, model.ctx, model.vocab, model.tied ? "tied" : "untied", with_commas(params));
  for (const auto& [key, value] : rows) fmt::print(out, "  {:<7} {}\n", key, value);
  out.flush();
}

nlohmann::json config_json(const GptConfig& model, int64_t batch, uint64_t seed, double lr) {
  return {{"layers", model.layers}, {"hidden", model.hidden}, {"heads", model.heads},
          {"seq", model.ctx},       {"vocab", model.vocab},   {"tied", model.tied},
          {"batch", batch},         {"seed", seed},           {"lr", lr}};
}

void add_job_json(nlohmann::json& j, const Job& job, const RunConfig& run, Recompute recompute,
                  const nlohmann::json& param_digest) {
  j["world"] = job.world();
  j["launcher"] = launcher_name(job.env.launcher);
  j["backend"] = backend_name(job.backend);
  j["precision"] = precision_name(run.precision);
  j["recompute"] = recompute_name(recompute);
  j["config"] = config_json(run.model, run.batch, run.seed, run.lr);
  j["param_digest"] = param_digest;
}

nlohmann::json run_json(const StepLog& log, int64_t steps, const torch::Device& device) {
  return run_json(log.losses(), log.tokens_per_s(), steps, device);
}

nlohmann::json run_json(const std::vector<float>& losses, double tokens_per_s, int64_t steps,
                        const torch::Device& device) {
  nlohmann::json j;
  j["losses"] = losses;
  j["tokens_per_s"] = tokens_per_s;
  j["steps"] = steps;
  j["device"] = device.str();
  return j;
}

}  // namespace dtc
