// The skeleton of the course's training programs (lesson 02 on), so that each lesson's run()
// shows only what is specific to it. Read top to bottom, as nanoGPT's train.py or torchtitan's
// trainer read:
//
//   1. configuration  TrainCli: the flags every training program shares (dtc/cli.h,
//                     dtc/model_flags.h), checked by CLI11's validators, plus the program's own
//   2. build          Job::start: the launch environment, the device, the process group
//   3. loop           StepLog: each step's loss and time, one progress line every tenth of the
//                     run (step, loss, tokens/s, time left), the median step time
//   4. report         run_json: the --json keys every program shares; print_json_line
//   5. finish         Job::finish: a last barrier, so that no rank leaves while another needs it
//
//   dtc::TrainCli cli("lesson02", "Lesson 02: ...", /*default_steps=*/500);
//   cli.app().add_option("--save", save, "...");
//   return cli.run(argc, argv, err, [&] { ... return dtc::kExitOk; });
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <utility>
#include <vector>

#include "dtc/cli.h"
#include "dtc/compat.h"
#include "dtc/dist.h"
#include "dtc/format.h"
#include "dtc/launch.h"
#include "dtc/model.h"
#include "dtc/trace.h"

namespace dtc {

// ---------------------------------------------------------------------------------------------
// 1. Configuration
// ---------------------------------------------------------------------------------------------

/// The options every training program shares.
struct TrainOptions {
  TrainFlags train;     ///< --steps, --seed, --global-batch, --json, --backend
  GptConfig model;      ///< --layers, --hidden, --heads, --seq
  bool untied = false;  ///< --untied: a separate output head
  double lr = 3e-3;     ///< --lr: AdamW's learning rate (lesson 02's)
  int timeout_s = 60;   ///< --timeout-s (TrainCli::add_timeout_flag): how long a collective waits
  /// --precision, --grad-dtype, --recompute (TrainCli::add_precision_flags)
  Precision precision = Precision::kFp32;
  std::string grad_dtype = "working";
  Recompute recompute = Recompute::kNone;
  /// --trace DIR: a Chrome trace of every rank (DIR/rank{r}.json, and DIR/trace.json merged),
  /// for Perfetto or scripts/trace_svg.py; empty: off (dtc/trace.h)
  std::string trace;

  /// The model the flags describe: tied unless --untied, checked (dtc::validate).
  /// @throws UsageError naming the flag when the shape does not make a model
  GptConfig model_config() const;
  /// The run the flags describe: model_config(), --global-batch, --seed and --lr, AdamW's other
  /// hyperparameters at lesson 02's defaults. @throws UsageError as model_config()
  RunConfig run_config() const;
};

/// A training program's command line: CLI11's App with the shared flags, each checked by a
/// CLI11 validator whose message says how to fix it, and the course's exit codes (run_cli).
class TrainCli {
 public:
  /// @param name the program's name (lessonNN), for messages
  /// @param description the first lines of --help
  /// @param default_steps --steps when not given
  /// @param untied_flag whether the program offers --untied (the pipeline's model is always
  ///   untied)
  TrainCli(std::string name, std::string description, int64_t default_steps = 20,
           bool untied_flag = true);

  CLI::App& app() { return app_; }
  /// Adds --timeout-s, the seconds a collective may wait before it fails (multi-rank programs).
  void add_timeout_flag();
  /// Adds --precision fp32|bf16|fp16, --grad-dtype working|fp32 and --recompute
  /// none|selective|full (lesson 02, parts 4 and 5).
  void add_precision_flags();
  /// Adds --precision alone, with the values @p allowed (lessons that train fp32 and bf16 only:
  /// fp16 needs lesson 02's loss scaler).
  void add_precision_flag(const std::vector<Precision>& allowed = {
                              Precision::kFp32, Precision::kBf16, Precision::kFp16});
  /// Adds --recompute alone, with the modes @p allowed (the pipeline recomputes whole stages:
  /// none or full).
  void add_recompute_flag(const std::vector<Recompute>& allowed = {
                              Recompute::kNone, Recompute::kSelective, Recompute::kFull});
  const TrainOptions& options() const { return options_; }

  /// Parses @p argv and runs @p body (dtc::run_cli: usage errors exit 2 with a hint).
  int run(int argc, const char* const* argv, std::ostream& err, const std::function<int()>& body);

 private:
  CLI::App app_;
  TrainOptions options_;
};

// ---------------------------------------------------------------------------------------------
// 2. Build: who am I, which device, and the process group
// ---------------------------------------------------------------------------------------------

/// One rank's place in the job, its device and its communicator.
struct Job {
  LaunchEnv env;
  BackendKind backend = BackendKind::kGloo;
  torch::Device device{torch::kCPU};
  c10::intrusive_ptr<c10d::Store> store;  ///< the job's store (a HashStore for one rank)
  c10::intrusive_ptr<Comm> comm;          ///< all ranks
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  /// --trace DIR, set before connect(): connect() then puts this rank on rank 0's clock, makes
  /// the tracer this thread's active one and wraps comm in a TracingComm ("world"); finish()
  /// writes the trace
  std::string trace_dir;
  std::shared_ptr<Tracer> tracer;  ///< this rank's timeline with --trace, else null

  int rank() const { return comm ? comm->getRank() : env.rank; }
  int world() const { return comm ? comm->getSize() : env.world_size; }
  /// Rank 0 does the side work: logs, --json, checkpoints.
  bool rank0() const { return rank() == 0; }

  /// Reads the launch environment (a program without a launcher is rank 0 of 1) and takes the
  /// device (cuda:LOCAL_RANK with NCCL, else the CPU), without touching the network: a program
  /// checks what depends on the world size between prepare() and connect(), so that bad input
  /// is exit 2 on every rank.
  /// @throws UsageError for a bad launch environment, or NCCL without a usable GPU
  /// @param backend --backend: "gloo" or "nccl"
  /// @param timeout how long a collective may wait before it fails
  /// @param lookup where the launch variables come from (tests pass their own)
  static Job prepare(const std::string& backend, std::chrono::milliseconds timeout,
                     const EnvLookup& lookup = process_env);

  /// Joins the process group (a HashStore and no network for one rank); every collective then
  /// fails after the timeout instead of hanging.
  void connect();

  /// prepare(), then connect().
  static Job start(const std::string& backend, std::chrono::milliseconds timeout);

  /// @p comm (a subgroup of global @p ranks, in its rank order), traced on this rank's timeline
  /// as @p group when tracing, else itself.
  c10::intrusive_ptr<Comm> traced(c10::intrusive_ptr<Comm> comm, const std::string& group,
                                  std::vector<int> ranks) const;

  /// A last barrier: every rank has finished its collectives before any leaves; with --trace,
  /// then writes the trace (dtc::write_trace).
  void finish();

 private:
  void start_trace();
  std::shared_ptr<TraceScope> trace_scope_;
};

/// Checks that @p global_batch splits into @p world ranks x @p accum micro-batches of equal size
/// (equal shards: the mean of the ranks' mean losses is then the global mean).
/// @throws UsageError("--global-batch") naming the sizes and the nearest batches that work,
///   ("--accum") for fewer than one micro-batch
void check_batch_split(int64_t global_batch, int world, int64_t accum = 1);

/// Bytes this machine can still give a process on @p device: on the CPU, the kernel's
/// MemAvailable (/proc/meminfo), else the physical memory; -1 where it cannot tell (a GPU:
/// the caching allocator's own error says it there).
int64_t available_memory(const torch::Device& device);

/// Refuses a run whose predicted memory cannot fit, before anything is allocated: throws
/// UsageError(@p flag) saying @p need_bytes (and @p what makes them up) against what
/// available_memory() reports, with @p hint. Does nothing where the memory is unknown.
void check_fits_in_memory(int64_t need_bytes, const torch::Device& device, const std::string& flag,
                          const std::string& what, const std::string& hint);

/// The device of a rank: with NCCL, cuda:@p index, or cuda:0 when the process sees one GPU (one
/// bound to each task, as `srun --gpus-per-task=1` does; lesson 04's pick_device), made the
/// calling thread's current device; else the CPU. @p variable names where the index came from
/// (LOCAL_RANK; lesson 06's pitfall: RANK), for the error and its @p hint.
/// @throws UsageError("--backend") for NCCL with no GPU, (@p variable) for an index past the
///   node's GPUs; the default hint: start at most that many ranks per node.
torch::Device rank_device(BackendKind backend, int index,
                          const std::string& variable = "LOCAL_RANK", std::string hint = "");

// ---------------------------------------------------------------------------------------------
// 3. The loop
// ---------------------------------------------------------------------------------------------

/// Each step's loss and time, and a progress line every tenth of the run on rank 0; a long run
/// (kLongRun steps or more) also says how long it has left (and, when tracing, a "step N" span):
///   step  50/500  loss 3.2529      1.5k tokens/s  ETA 2:30
///   [rank 0] step  2/20  loss 4.8937      3.5k tokens/s
class StepLog {
 public:
  static constexpr int64_t kLongRun = 100;

  /// @param err where progress goes (stderr)
  /// @param talk whether this rank prints (rank 0)
  /// @param first the first step of this run (a resumed run starts past 0)
  /// @param steps the step to stop before
  /// @param tokens_per_step tokens of one step over all ranks, for tokens/s
  /// @param prefix before each line, e.g. "[rank 0] "
  StepLog(std::ostream& err, bool talk, int64_t first, int64_t steps, int64_t tokens_per_step,
          std::string prefix = "");

  /// Marks the start of a step (the time of the steps that end_step() records).
  void begin_step();
  /// Records @p step's loss and time since begin_step(); prints its line when due.
  void end_step(int64_t step, float loss);

  const std::vector<float>& losses() const { return losses_; }
  const std::vector<double>& step_seconds() const { return step_s_; }
  /// Seconds from construction to the end of the last recorded step.
  double elapsed_s() const;
  /// Tokens of the recorded steps per second of elapsed_s().
  double tokens_per_s() const;
  /// The median step time after @p warmup steps (all of them when there are too few).
  double median_step_s(size_t warmup = 2) const;

 private:
  std::ostream& err_;
  bool talk_;
  int64_t steps_, tokens_per_step_, every_;
  bool long_run_;
  std::string prefix_;
  std::chrono::steady_clock::time_point start_, step_start_, end_;
  TraceTime trace_start_;
  std::vector<float> losses_;
  std::vector<double> step_s_;
};

/// Stops a resumed run that has nothing left to do.
/// @throws UsageError("--steps") when the checkpoint's step @p first is not before @p steps
void check_resume_step(int64_t first, int64_t steps);

// ---------------------------------------------------------------------------------------------
// 4. The report
// ---------------------------------------------------------------------------------------------

/// The banner on rank 0's stdout, the same first lines in every program, then the program's own
/// rows (each "  {key:<7} {value}"):
///   Lesson 07: ZeRO
///     job     2 rank(s) via torchrun, gloo on cpu, LibTorch 2.15.0
///     model   GPT, 4 layers, hidden 128, 4 heads, seq 64, vocab 256, tied head: 834,304 parameters
///     train   AdamW lr 0.003, 20 steps, global batch 8 (4 per rank), seed 1
/// @param params the model's parameter count (all ranks together)
void print_banner(std::ostream& out, const std::string& title, const Job& job,
                  const GptConfig& model, int64_t params,
                  const std::vector<std::pair<std::string, std::string>>& rows);

/// The model and run settings under "config" in every program's --json line.
nlohmann::json config_json(const GptConfig& model, int64_t batch, uint64_t seed, double lr);

/// The --json keys every distributed training program shares about its job and run, in one
/// place: "world" (the ranks), "launcher", "backend" ("gloo" or "nccl"), "precision",
/// "recompute", "config" (config_json of @p run) and "param_digest". Sets them in @p j; the
/// program adds its own keys.
void add_job_json(nlohmann::json& j, const Job& job, const RunConfig& run, Recompute recompute,
                  const nlohmann::json& param_digest);

/// The --json keys every training program shares: "losses", "tokens_per_s", "steps" and
/// "device" (each program adds its own, then print_json_line()).
nlohmann::json run_json(const StepLog& log, int64_t steps, const torch::Device& device);
/// The same keys from a run's @p losses and @p tokens_per_s.
nlohmann::json run_json(const std::vector<float>& losses, double tokens_per_s, int64_t steps,
                        const torch::Device& device);

}  // namespace dtc
