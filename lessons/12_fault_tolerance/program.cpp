// The lesson12 program: lesson 11's N-D training with the distributed checkpoint you wrote in
// checkpoint.cpp: every --checkpoint-every steps each rank saves its pieces, and a run whose
// --checkpoint-dir holds a committed checkpoint resumes from the newest one, on whatever mesh it
// was saved. --fail-at-step kills a rank (SIGKILL, its own process) in the first attempt only, so
// that torchrun --max-restarts restarts the job and the restarted attempt resumes. Given in full.
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <unistd.h>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <optional>
#include <ostream>
#include <random>
#include <thread>

#include "checkpoint.h"
#include "dtc/cli.h"
#include "dtc/dist.h"
#include "dtc/errors.h"
#include "dtc/program.h"
#include "state.h"

namespace dtc::l12 {
namespace {

struct Flags {
  std::string mix;  // --mix; empty: every rank a dp replica
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  bool no_resume = false;
  bool async_save = false;
  int64_t fail_at_step = -1;
  int64_t fail_every = 0;
  int64_t hang_at_step = -1;
  int fail_rank = 0;
};

// torchrun's count of this job's restarts (0 in the first attempt, and without torchrun).
int restart_count() {
  const char* v = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return v == nullptr ? 0 : std::atoi(v);
}

// The step every rank resumes from: rank 0's newest committed checkpoint, told to every rank
// (ranks on other machines may list a shared directory a moment apart).
std::optional<int64_t> agreed_latest(Fs& fs, const std::string& root, Comm& world) {
  int64_t latest = -1;
  if (world.getRank() == 0) latest = latest_checkpoint(fs, root).value_or(-1);
  std::vector<at::Tensor> t{torch::tensor({latest}, torch::kInt64)};
  world.broadcast(t)->wait();
  latest = t[0].item<int64_t>();
  return latest < 0 ? std::nullopt : std::optional<int64_t>(latest);
}

int run(const TrainOptions& t, const Flags& f, std::ostream& out, std::ostream& err) {
  // 1. Configuration, checked on every rank before the network is touched.
  if (t.train.backend != "gloo") {
    throw UsageError(
        "--backend",
        fmt::format("{}: lesson 12's save exchanges its records as CPU tensors", t.train.backend),
        "run it on gloo (--backend gloo, the default)");
  }
  Job job = Job::prepare(t.train.backend, std::chrono::seconds(t.timeout_s));
  const int world = job.env.world_size;
  l11::NdOptions o;
  static_cast<RunConfig&>(o) = t.run_config();
  o.steps = t.train.steps;
  o.mix = parse_mix(f.mix.empty() ? fmt::format("{}x1x1x1", world) : f.mix, "--mix");
  o.schedule =
      o.mix.virtual_stages > 1 ? l09::ScheduleKind::kInterleaved : l09::ScheduleKind::k1f1b;
  o.device = job.device;
  o.digest = true;
  if (f.checkpoint_every > 0 && f.checkpoint_dir.empty()) {
    throw UsageError("--checkpoint-every", "a checkpoint interval without a directory",
                     "pass --checkpoint-dir DIR too");
  }
  if (f.fail_at_step >= o.steps) {
    throw UsageError("--fail-at-step",
                     fmt::format("step {} of a run of {} steps", f.fail_at_step, o.steps),
                     fmt::format("pass a step from 0 to {}", o.steps - 1));
  }
  if (f.fail_every > 0 && f.fail_at_step >= 0) {
    throw UsageError("--fail-every", "with --fail-at-step too",
                     "pass one of them: --fail-every N fails every attempt, --fail-at-step K "
                     "the first");
  }
  if (f.hang_at_step >= o.steps) {
    throw UsageError("--hang-at-step",
                     fmt::format("step {} of a run of {} steps", f.hang_at_step, o.steps),
                     fmt::format("pass a step from 0 to {}", o.steps - 1));
  }
  if (f.fail_rank >= world) {
    throw UsageError("--fail-rank", fmt::format("rank {} of {} ranks", f.fail_rank, world),
                     fmt::format("pass a rank from 0 to {}", world - 1));
  }
  l11::check_nd(o, world);

  // 2. Build: the process group, the mesh's groups, the rank's model and optimizer.
  job.connect();
  const Mesh mesh = l11::make_mesh(o.mix, world);
  const l11::NdGroups groups = l11::make_groups(job.store, mesh, job.rank(), o.mix.zero_stage,
                                                job.backend, job.timeout, job.env.master_addr);
  l11::NdTrainer trainer(o, groups);
  const int restarts = restart_count();
  PosixFs fs;
  const bool talk = job.rank0() && !t.train.json;

  // 3. Resume: the newest committed checkpoint in --checkpoint-dir, on this mesh.
  int64_t first = 0;
  std::vector<float> losses;
  std::optional<int64_t> resumed;
  double load_s = 0;
  if (!f.checkpoint_dir.empty() && !f.no_resume) {
    resumed = agreed_latest(fs, f.checkpoint_dir, *job.comm);
    if (resumed) {
      const auto start = std::chrono::steady_clock::now();
      std::vector<StatePiece> pieces = rank_state(trainer, groups, o);
      const Metadata m = load_checkpoint(fs, step_dir(f.checkpoint_dir, *resumed), pieces);
      const nlohmann::json& train = m.train;
      if (train.value("seed", o.seed) != o.seed) {
        throw UsageError(
            "--checkpoint-dir",
            fmt::format("{} was saved by a run of seed {}, this one has {}",
                        step_dir(f.checkpoint_dir, *resumed), train.value("seed", o.seed), o.seed),
            "pass the same --seed, another --checkpoint-dir, or --no-resume");
      }
      state_loaded(trainer, *resumed);
      losses = train.value("losses", std::vector<float>{});
      first = *resumed;
      load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      check_resume_step(first, o.steps);
    }
  }
  if (talk) {
    print_banner(
        out, "Lesson 12: failures at scale", job, o.model, count_parameters(*Gpt(o.model)),
        {{"mix", fmt::format("{} = {}", o.mix.text(), mesh.describe())},
         {"ckpt", f.checkpoint_dir.empty()
                      ? std::string("none")
                      : fmt::format("{} every {} steps{}", f.checkpoint_dir, f.checkpoint_every,
                                    resumed ? fmt::format(", resumed from step {}", *resumed)
                                            : std::string())},
         {"train", fmt::format("AdamW lr {:g}, {} steps, global batch {}, seed {}, "
                               "attempt {}",
                               o.lr, o.steps, o.batch, o.seed, restarts + 1)}});
  }

  // 4. The loop, a checkpoint every --checkpoint-every steps. The saves run on a communicator of
  // their own: with --async-save they run on a thread beside the training's collectives, and two
  // threads must not share one communicator.
  std::vector<int> all(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) all[static_cast<size_t>(r)] = r;
  const c10::intrusive_ptr<Comm> save_comm =
      new_subgroup(job.store, "checkpoint", all, job.rank(), BackendKind::kGloo, job.timeout,
                   job.env.master_addr);
  StepLog log(err, talk, first, o.steps, o.batch * o.model.ctx);
  std::vector<int64_t> saved;
  double stall_s = 0;  // what the saves kept training waiting
  int64_t saved_bytes = 0;
  std::thread writer;  // --async-save: the save in flight
  std::exception_ptr writer_error;
  // On every way out (a collective failed because a peer died): the writer joined, never a
  // joinable thread destroyed (std::terminate).
  struct JoinOnExit {
    std::thread& t;
    ~JoinOnExit() {
      if (t.joinable()) t.join();
    }
  } join_on_exit{writer};
  const auto wait_for_writer = [&] {
    if (writer.joinable()) writer.join();
    if (writer_error) std::rethrow_exception(writer_error);
  };
  int64_t fail_after = -1;  // --fail-every: the steps this attempt lives
  if (f.fail_every > 0) {
    std::mt19937_64 draw(o.seed + 1000003ULL * static_cast<uint64_t>(restarts + 1));
    fail_after =
        f.fail_every / 2 + static_cast<int64_t>(draw() % static_cast<uint64_t>(f.fail_every));
  }
  const auto loop_start = std::chrono::steady_clock::now();
  for (int64_t step = first; step < o.steps; ++step) {
    // --fail-every M: each attempt is killed after M/2 + u steps of its own, u in [0, M) drawn
    // from (seed, attempt): a failure every M steps of progress on average, at no fixed place
    // relative to the saves (goodput, README section 5).
    if (job.rank() == f.fail_rank && f.fail_every > 0 && step == first + fail_after) {
      fmt::print(err, "[rank {}] --fail-every {}: attempt {} killed before step {} of the log\n",
                 job.rank(), f.fail_every, restarts + 1, step + 1);
      err.flush();
      ::kill(::getpid(), SIGKILL);
    }
    if (job.rank() == f.fail_rank && restarts == 0) {  // the faults: the first attempt only
      if (step == f.fail_at_step) {
        fmt::print(err,
                   "[rank {}] --fail-at-step {}: killing my own process (SIGKILL) before "
                   "step {} of the log\n",
                   job.rank(), step, step + 1);
        err.flush();
        ::kill(::getpid(), SIGKILL);
      }
      if (step == f.hang_at_step) {
        fmt::print(err,
                   "[rank {}] --hang-at-step {}: I stop communicating before step {} of the "
                   "log; the others time out after --timeout-s {} s\n",
                   job.rank(), step, step + 1, t.timeout_s);
        err.flush();
        for (;;) ::pause();  // until torchrun stops the job
      }
    }
    log.begin_step();
    const l11::StepOut step_out = trainer.step(step);
    losses.push_back(step_out.loss);
    log.end_step(step, step_out.loss);
    if (f.checkpoint_every > 0 && (step + 1) % f.checkpoint_every == 0) {
      const auto start = std::chrono::steady_clock::now();
      std::vector<StatePiece> pieces = rank_state(trainer, groups, o);
      const nlohmann::json train = {{"step", step + 1},
                                    {"seed", o.seed},
                                    {"losses", losses},
                                    {"mix", o.mix.text()},
                                    {"world", world}};
      for (const StatePiece& p : pieces) {
        if (p.write) saved_bytes += p.box.numel() * 4;
      }
      if (f.async_save) {
        wait_for_writer();  // one save in flight at a time
        // Staged: a copy of every piece this rank writes, which the next steps cannot change.
        std::vector<StatePiece> staged;
        for (const StatePiece& p : pieces) {
          if (!p.write) continue;
          StatePiece copy = p;
          copy.tensor = p.tensor.detach().clone();
          staged.push_back(std::move(copy));
        }
        writer = std::thread(
            [&fs, &f, &save_comm, &writer_error, staged = std::move(staged), train, at = step + 1] {
              try {
                save_checkpoint(fs, f.checkpoint_dir, at, staged, *save_comm, train);
              } catch (...) {
                writer_error = std::current_exception();
              }
            });
      } else {
        save_checkpoint(fs, f.checkpoint_dir, step + 1, pieces, *save_comm, train);
      }
      stall_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      saved.push_back(step + 1);
    }
  }
  {
    const auto start = std::chrono::steady_clock::now();
    wait_for_writer();  // the last save committed before the run reports it
    stall_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  const double train_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - loop_start).count();
  const l11::NdResult result = trainer.finish();

  // 5. Report.
  job.finish();
  if (!job.rank0()) return kExitOk;
  if (t.train.json) {
    nlohmann::json j = run_json(losses, log.tokens_per_s(), o.steps, job.device);
    add_job_json(j, job, o, o.mix.recompute == "full" ? Recompute::kFull : Recompute::kNone,
                 result.digest);
    j["mix"] = o.mix.text();
    j["restarts"] = restarts;
    j["resumed_from_step"] = resumed ? nlohmann::json(*resumed) : nlohmann::json(nullptr);
    j["checkpoints"] = saved;
    j["checkpoint"] = {{"stall_s", stall_s},
                       {"async", f.async_save},
                       {"train_s", train_s},
                       {"load_s", load_s},
                       {"rank0_bytes_per_save",
                        saved.empty() ? 0 : saved_bytes / static_cast<int64_t>(saved.size())}};
    print_json_line(out, j);
    return kExitOk;
  }
  fmt::print(out, "\n  trained steps {} to {} on {}: loss {:.4f} -> {:.4f}\n", first, o.steps - 1,
             mesh.describe(), losses.front(), losses.back());
  if (!saved.empty()) {
    fmt::print(out,
               "  saved {} checkpoint(s) (after steps {}){}: training waited {:.3f} s for them "
               "on rank 0, of {:.3f} s\n",
               saved.size(), fmt::join(saved, ", "), f.async_save ? " in the background" : "",
               stall_s, train_s);
  }
  if (resumed) {
    fmt::print(out, "  resumed from step {} (attempt {}), loaded in {:.3f} s\n", *resumed,
               restarts + 1, load_s);
  }
  return kExitOk;
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  TrainCli cli(
      "lesson12",
      "Lesson 12: failures at scale. Trains lesson 11's N-D model with distributed checkpoints;\n"
      "a run resumes from the newest complete checkpoint in --checkpoint-dir, on any mesh:\n"
      "  torchrun --standalone --nproc_per_node=4 --max-restarts=1 --no_python build/bin/lesson12"
      " \\\n      --mix 2x1x2x1 --checkpoint-dir /tmp/ckpt --checkpoint-every 2 --fail-at-step 5");
  cli.add_timeout_flag();
  Flags f;
  CLI::App& app = cli.app();
  app.add_option("--mix", f.mix,
                 "DPxTPxPPxCP[:ZERO[:RECOMPUTE[:MICRO[:VIRTUAL]]]], lesson 11's; default: every "
                 "rank a dp replica");
  app.add_option("--checkpoint-dir", f.checkpoint_dir,
                 "where checkpoints go (DIR/step_NNNNNNNN); a run resumes from the newest "
                 "committed one there unless --no-resume");
  app.add_option("--checkpoint-every", f.checkpoint_every, "save after every N steps (0: never)")
      ->check(non_negative_count("--checkpoint-every 10"))
      ->capture_default_str();
  app.add_flag("--async-save", f.async_save,
               "save in the background: the pieces copied (staged), then written by a thread "
               "while training goes on; one save in flight at a time");
  app.add_flag("--no-resume", f.no_resume,
               "start from step 0 even when --checkpoint-dir holds a checkpoint");
  app.add_option("--fail-at-step", f.fail_at_step,
                 "kill --fail-rank's own process (SIGKILL) as step K starts, in the first attempt "
                 "only (TORCHELASTIC_RESTART_COUNT 0)")
      ->check(non_negative_count("--fail-at-step 3"));
  app.add_option("--fail-every", f.fail_every,
                 "kill --fail-rank's process in every attempt, after M/2 + u of its steps (u in "
                 "[0, M) drawn from the seed and the attempt): a failure every M steps on "
                 "average, under torchrun --max_restarts (goodput)")
      ->check(non_negative_count("--fail-every 50"));  // M
  app.add_option("--hang-at-step", f.hang_at_step,
                 "--fail-rank stops communicating (sleeps) as step K starts, in the first attempt "
                 "only: the others' collectives time out after --timeout-s, they exit, and "
                 "torchrun restarts the job")
      ->check(non_negative_count("--hang-at-step 3"));
  app.add_option("--fail-rank", f.fail_rank,
                 "the rank --fail-at-step kills (or --hang-at-step stops)")
      ->check(non_negative_count("--fail-rank 1"))
      ->capture_default_str();
  return cli.run(argc, argv, err, [&] { return run(cli.options(), f, out, err); });
}

int run_main(int argc, char** argv) { return run_program(argc, argv, std::cout, std::cerr); }

}  // namespace dtc::l12
