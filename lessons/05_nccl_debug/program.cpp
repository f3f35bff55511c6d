// The lesson05 program: `doctor`, `fault --case C`, `nccl-log FILE [--link A B]` and
// `interfaces [--cluster IF]`, `fr-analyze FILE...`. Given in full.
//
// The fault lab's cases, each ending within --timeout-ms with a diagnosis ("DIAGNOSIS: ..." on
// stderr of the rank that saw it), never a hang:
//   skip-collective   rank 1 skips the first allreduce and goes on to the broadcast
//   shape-mismatch    rank 1 allreduces 8 elements, the others 4
//   wrong-world-size  every rank believes the job has one rank more than it has
//   missing-rank      the last rank exits at once, as if it never started
//   port-in-use       a second store server on a port that the first holds (one process)
//   bad-ifname        GLOO_SOCKET_IFNAME names an interface that does not exist (one process)
//   none              a healthy run: the barrier and two checked collectives
// --no-check runs the collectives without fingerprints, to see what happens without the aid.
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <optional>
#include <ostream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "debug_aids.h"
#include "doctor.h"
#include "dtc/cli.h"
#include "dtc/dist.h"
#include "dtc/errors.h"
#include "dtc/todo.h"
#include "flight_recorder.h"
#include "nccl_log.h"
#include "nccl_reading.h"

namespace dtc::l05 {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string fault = "none";
  int timeout_ms = 5000;
  bool no_check = false;
  std::string ifname = "nosuch0";
  std::vector<std::string> logs;
  std::vector<int> link;                // nccl-log --link A B
  std::string cluster;                  // interfaces --cluster IF
  std::vector<std::string> interfaces;  // interfaces --interfaces a,b (default: this machine's)
  std::string fr_dump;                  // fault --fr-dump DIR: each rank's Flight Recorder trace
  std::vector<std::string> fr_files;    // fr-analyze FILE...
  bool json = false;
};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int diagnosed(std::ostream& err, int rank, const std::string& what, Clock::time_point t0) {
  fmt::print(err, "rank {}: DIAGNOSIS: {}\nrank {}: (ended after {:.1f} s)\n", rank, what, rank,
             seconds_since(t0));
  return kExitFailure;
}

// --- the one-process cases --------------------------------------------------------------
int fault_port_in_use(const Options& o, std::ostream& out, std::ostream& err,
                      Clock::time_point t0) {
  const auto timeout = std::chrono::milliseconds(o.timeout_ms);
  // The first server takes a free port (0: the kernel picks); the second asks for the same one.
  auto first = new_tcp_store("127.0.0.1", 0, /*is_server=*/true, 1, timeout);
  const int port = tcp_store_port(first);
  fmt::print(out, "a store server holds 127.0.0.1:{}; starting a second one there\n", port);
  try {
    auto second = new_tcp_store("127.0.0.1", port, true, 1, timeout);
  } catch (const std::exception& e) {
    const std::string first_line =
        std::string(e.what()).substr(0, std::string(e.what()).find('\n'));
    return diagnosed(err, 0,
                     fmt::format("MASTER_PORT {} is already in use ({}). Fix: choose another "
                                 "--master_port, or stop the job that holds it (`ss -ltnp "
                                 "'sport = :{}'`); `lesson05 doctor` checks it before a launch",
                                 port, first_line, port),
                     t0);
  }
  fmt::print(err, "rank 0: the second server started: the port was not in use?\n");
  return kExitOk;
}

int fault_bad_ifname(const Options& o, const EnvLookup& env, std::ostream& err,
                     Clock::time_point t0) {
  // The doctor sees it before any process starts...
  auto lookup = [&](const std::string& name) -> std::optional<std::string> {
    if (name == "GLOO_SOCKET_IFNAME") return o.ifname;
    return std::nullopt;
  };
  for (const auto& f : run_doctor(lookup, real_machine())) {
    if (f.severity == Severity::kError) {
      fmt::print(err, "rank 0: doctor: {}: {} (fix: {})\n", f.subject, f.problem, f.fix);
    }
  }
  // ...and gloo fails when it creates its device on that interface.
  try {
    auto device = c10d::ProcessGroupGloo::createDeviceForInterface(o.ifname);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    return diagnosed(err, 0,
                     fmt::format("GLOO_SOCKET_IFNAME={} does not exist here; gloo says: {}. Fix: "
                                 "set it to an interface from `ip -br addr` (NCCL: "
                                 "NCCL_SOCKET_IFNAME), or unset it",
                                 o.ifname, what.substr(0, what.find('\n'))),
                     t0);
  }
  (void)env;
  fmt::print(err, "rank 0: interface '{}' exists: not a fault here\n", o.ifname);
  return kExitOk;
}

// --- the multi-rank cases ------------------------------------------------------------------
// fault --fr-dump DIR: writes this rank's Flight Recorder trace to DIR/rank<r>.json, from a
// thread of its own: after `in_flight` if the run has not finished by then, else at finish().
class FrWriter {
 public:
  FrWriter(std::string dir, int rank, std::chrono::milliseconds in_flight, std::ostream& err)
      : dir_(std::move(dir)), rank_(rank) {
    if (dir_.empty()) return;
    thread_ = std::thread([this, in_flight, &err] {
      std::unique_lock lock(mutex_);
      const bool finished = cv_.wait_for(lock, in_flight, [this] { return done_; });
      if (finished) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const auto path = std::filesystem::path(dir_) / fmt::format("rank{}.json", rank_);
      std::ofstream(path) << flight_recorder_json().value_or("") << "\n";
      fmt::print(err, "rank {}: Flight Recorder trace written to {} ({})\n", rank_, path.string(),
                 finished ? "at the end" : "a collective still in flight");
    });
  }
  FrWriter(const FrWriter&) = delete;
  FrWriter& operator=(const FrWriter&) = delete;
  ~FrWriter() { finish(); }
  /// The run is over: write now (if not written yet) and wait for the file.
  void finish() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::string dir_;
  int rank_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

int fault_distributed(const Options& o, const EnvLookup& env_lookup, std::ostream& out,
                      std::ostream& err, Clock::time_point t0) {
  const auto env = read_launch_env(env_lookup);
  require_world_size(env, 2, "lesson05 fault --case " + o.fault);
  const int rank = env.rank;
  const auto timeout = std::chrono::milliseconds(o.timeout_ms);

  if (o.fault == "missing-rank" && rank == env.world_size - 1) {
    fmt::print(err, "rank {}: fault case missing-rank: exiting without joining\n", rank);
    return kExitOk;
  }
  // The store first, then the barrier, and only then the communicator: creating a gloo
  // communicator is itself a rendezvous that would wait for the missing rank without naming it.
  auto store = connect_store(env, timeout);
  const int believed_world = o.fault == "wrong-world-size" ? env.world_size + 1 : env.world_size;
  try {
    barrier_with_report(*store, "start", rank, believed_world, timeout);
  } catch (const MissingRanksError& e) {
    std::string what = e.what();
    if (o.fault == "wrong-world-size") {
      what += fmt::format(
          ". This rank was told the job has {} ranks but only {} started: "
          "WORLD_SIZE and --nproc_per_node x --nnodes disagree",
          believed_world, env.world_size);
    } else {
      what +=
          ". Look at the missing rank's own log: it crashed, was never started, or is stuck "
          "before the barrier";
    }
    return diagnosed(err, rank, what, t0);
  }
  auto comm = new_comm(store, rank, env.world_size, BackendKind::kGloo, timeout, env.master_addr);
  // --fr-dump DIR: this rank's Flight Recorder trace, as PyTorch's watchdog takes it on NCCL: at
  // half the timeout while a collective is still in flight (gloo marks a collective that failed
  // by its timeout "completed", so a dump after the error would show no hang), or at the end of
  // a run that finished (after 200 ms: gloo's worker thread marks a collective completed just
  // after wait() returns, seen in real dumps).
  FrWriter fr_writer(o.fr_dump, rank, timeout / 2, err);
  const auto dumped = [&](int code) {
    fr_writer.finish();
    return code;
  };
  if (o.fault == "stuck-rank") {
    // The last rank is alive but never reaches the barrier (a rank stuck in its own work): gloo's
    // monitoredBarrier, PyTorch's who-is-missing barrier, names it on rank 0.
    if (rank == env.world_size - 1) {
      std::this_thread::sleep_for(timeout + std::chrono::milliseconds(1500));
      fmt::print(err, "rank {}: fault case stuck-rank: never entered the barrier\n", rank);
      return dumped(kExitOk);
    }
    c10d::BarrierOptions opts;
    opts.timeout = timeout;
    try {
      comm->monitoredBarrier(opts, /*waitAllRanks=*/true);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      return dumped(
          diagnosed(err, rank, "monitoredBarrier: " + what.substr(0, what.find('\n')), t0));
    }
    return dumped(kExitOk);
  }
  CheckedComm checked(store, comm, timeout, !o.no_check);

  std::vector<at::Tensor> a{torch::ones({o.fault == "shape-mismatch" && rank == 1 ? 8 : 4})};
  std::vector<at::Tensor> b{torch::full({2}, static_cast<float>(rank))};
  try {
    if (!(o.fault == "skip-collective" && rank == 1)) checked.allreduce(a);
    checked.broadcast(b, 0);
  } catch (const CollectiveMismatchError& e) {
    return dumped(diagnosed(err, rank, e.what(), t0));
  } catch (const MissingRanksError& e) {
    return dumped(diagnosed(err, rank, e.what(), t0));
  } catch (const TodoError&) {
    throw;  // an unfinished exercise is not a fault: run_cli reports it (exit 3)
  } catch (const std::exception& e) {
    // --no-check: what the library itself says (a timeout, a size error, or worse: nothing).
    return dumped(diagnosed(err, rank,
                            fmt::format("the collective failed without fingerprints: {}",
                                        std::string(e.what()).substr(0, 400)),
                            t0));
  }
  // Without the check, a mismatch can also "succeed" with wrong numbers: show them.
  const double sum = a[0].sum().item<double>();
  if (rank == 0) {
    fmt::print(out, "{} ranks: barrier passed, {} collectives {}; allreduce sum {} (expected {})\n",
               env.world_size, checked.calls(), o.no_check ? "unchecked" : "matched", sum,
               4.0 * env.world_size);
    if (o.json) {
      print_json_line(out,
                      {{"ok", true}, {"world_size", env.world_size}, {"calls", checked.calls()}});
    }
  }
  return dumped(kExitOk);
}

int run_fault(const Options& o, const EnvLookup& env, std::ostream& out, std::ostream& err) {
  const auto t0 = Clock::now();
  if (o.fault == "port-in-use") return fault_port_in_use(o, out, err, t0);
  if (o.fault == "bad-ifname") return fault_bad_ifname(o, env, err, t0);
  return fault_distributed(o, env, out, err, t0);
}

std::string joined(const std::vector<std::string>& items) {
  return fmt::format("{}", fmt::join(items, ", "));
}

// nccl-log FILE --link A B: your read_link() and explain_link() on the job's environment.
int run_link(const Options& o, const NcclLogSummary& summary, const EnvLookup& env,
             std::ostream& out) {
  const int from = o.link[0], to = o.link[1];
  const auto reading = read_link(summary, from, to);
  if (!reading) {
    std::vector<std::string> present;
    for (const auto& l : summary.links) {
      const auto text = fmt::format("{}->{}", l.from, l.to);
      if (std::find(present.begin(), present.end(), text) == present.end()) present.push_back(text);
    }
    throw UsageError("nccl-log --link", fmt::format("the log has no connection {} -> {}", from, to),
                     present.empty() ? "this log has no connection lines (NCCL_DEBUG=INFO?)"
                                     : "its connections are " + joined(present));
  }
  const auto d = explain_link(*reading, env);
  if (o.json) {
    nlohmann::json j{{"from", from},
                     {"to", to},
                     {"via", reading->via},
                     {"family", reading->family},
                     {"same_node", reading->same_node},
                     {"gpu_direct", reading->gpu_direct},
                     {"healthy", d.healthy},
                     {"variables", d.variables},
                     {"why", d.why}};
    out << j.dump() << "\n";
  } else {
    out << fmt::format("{} -> {}: {} ({}{}), {}\n", from, to, reading->family, reading->via,
                       reading->gpu_direct ? ", GPUDirect RDMA" : "",
                       reading->same_node ? "one node" : "two nodes");
    out << fmt::format("{}: {}\n", d.healthy ? "healthy" : "NOT HEALTHY", d.why);
    if (!d.variables.empty()) out << "variables: " << joined(d.variables) << "\n";
  }
  return d.healthy ? kExitOk : kExitFailure;
}

int run_nccl_log(const Options& o, const EnvLookup& env, std::ostream& out) {
  if (!o.link.empty() && o.logs.size() != 1) {
    throw UsageError("nccl-log --link", "--link reads one log", "give one file with --link");
  }
  for (const auto& path : o.logs) {
    std::ifstream in(path);
    if (!in) throw UsageError("nccl-log", "cannot read '" + path + "'", "give a log file path");
    const auto summary = parse_nccl_log(in);
    if (!o.link.empty()) return run_link(o, summary, env, out);
    out << "== " << path << "\n";
    print_nccl_summary(out, summary);
  }
  return kExitOk;
}

// fr-analyze FILE...: your analyze_flight_recorder() on the ranks' dumps (fault --fr-dump).
int run_fr_analyze(const Options& o, std::ostream& out) {
  static const std::regex rank_re(R"(rank(\d+)\.json$)");
  std::vector<FrDump> dumps;
  for (const auto& path : o.fr_files) {
    std::smatch m;
    if (!std::regex_search(path, m, rank_re)) {
      throw UsageError("fr-analyze", "cannot tell the rank of '" + path + "'",
                       "name the files rank<N>.json, as fault --fr-dump does");
    }
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    if (text.str().find_first_not_of(" \n") == std::string::npos) {
      throw UsageError(
          "fr-analyze", "'" + path + "' is empty",
          "this LibTorch has no Flight Recorder for gloo (1.13): use the primary path");
    }
    dumps.push_back({std::stoi(m[1]), text.str()});
  }
  const auto v = analyze_flight_recorder(dumps);
  if (o.json) {
    nlohmann::json calls = nlohmann::json::object();
    for (const auto& [rank, call] : v.calls) calls[std::to_string(rank)] = call;
    out << nlohmann::json{{"all_completed", v.all_completed},
                          {"seq", v.seq},
                          {"missing", v.missing},
                          {"waiting", v.waiting},
                          {"mismatch", v.mismatch},
                          {"calls", calls}}
               .dump()
        << "\n";
  } else {
    out << describe(v) << "\n";
  }
  return v.all_completed ? kExitOk : kExitFailure;
}

// interfaces [--cluster IF]: what NCCL_SOCKET_IFNAME selects here (your nccl_pick_interfaces()),
// and whether that is the cluster's network (your check_socket_ifname()).
int run_interfaces(const Options& o, const EnvLookup& env, std::ostream& out) {
  const auto names = o.interfaces.empty() ? nccl_visible_interfaces() : o.interfaces;
  const auto value = env("NCCL_SOCKET_IFNAME");
  const auto picked = nccl_pick_interfaces(value, names);
  std::optional<LinkDiagnosis> d;
  if (!o.cluster.empty()) {
    if (std::find(names.begin(), names.end(), o.cluster) == names.end()) {
      throw UsageError("interfaces --cluster", "'" + o.cluster + "' is not an interface here",
                       "use one of: " + joined(names));
    }
    d = check_socket_ifname(env, names, o.cluster);
  }
  if (o.json) {
    nlohmann::json j{{"interfaces", names},
                     {"socket_ifname", value ? nlohmann::json(*value) : nlohmann::json(nullptr)},
                     {"picked", picked}};
    if (!o.cluster.empty()) {
      j["cluster"] = o.cluster;
      j["ok"] = !d.has_value();
      j["why"] = d ? d->why : "";
    }
    out << j.dump() << "\n";
  } else {
    out << fmt::format("interfaces: {}\nNCCL_SOCKET_IFNAME {}: NCCL takes {}{}\n", joined(names),
                       value ? "= '" + *value + "'" : "unset",
                       picked.empty() ? "nothing (no socket interface found)" : joined(picked),
                       picked.empty() ? "" : "; bootstrap on " + picked[0]);
    if (!o.cluster.empty()) out << (d ? "NOT OK: " + d->why : "ok: only " + o.cluster) << "\n";
  }
  return d ? kExitFailure : kExitOk;
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
                const EnvLookup& env) {
  CLI::App app{"lesson05: NCCL and communication debugging: doctor, fault lab, NCCL log reader",
               "lesson05"};
  Options o;
  app.add_option("--timeout-ms", o.timeout_ms, "how long a rank waits for the others")
      ->check(CLI::Range(100, 600000))
      ->capture_default_str();
  app.add_flag("--json", o.json, "rank 0 prints one JSON object on the last line (healthy run)");
  auto* doctor = app.add_subcommand("doctor", "check the launch environment and the machine");
  auto* fault = app.add_subcommand("fault", "break a run on purpose and diagnose it");
  fault->add_option("--case", o.fault, "what to break")
      ->check(CLI::IsMember({"none", "skip-collective", "shape-mismatch", "wrong-world-size",
                             "missing-rank", "stuck-rank", "port-in-use", "bad-ifname"}))
      ->capture_default_str();
  fault->add_flag("--no-check", o.no_check, "no fingerprints: see what the library says alone");
  fault->add_option("--ifname", o.ifname, "the interface name for --case bad-ifname")
      ->capture_default_str();
  fault->add_option("--timeout-ms", o.timeout_ms, "how long a rank waits for the others")
      ->check(CLI::Range(100, 600000));
  auto* log = app.add_subcommand("nccl-log", "summarise NCCL_DEBUG=INFO logs");
  log->add_option("files", o.logs, "log files")->required()->check(CLI::ExistingFile);
  log->add_option("--link", o.link, "FROM TO: the transport between two ranks, and why")
      ->expected(2)
      ->check(CLI::NonNegativeNumber);
  log->add_flag("--json", o.json, "with --link: one JSON object");
  fault->add_option("--fr-dump", o.fr_dump, "write each rank's Flight Recorder trace here")
      ->check(CLI::ExistingDirectory);
  auto* fr = app.add_subcommand("fr-analyze", "line up the ranks' Flight Recorder dumps");
  fr->add_option("files", o.fr_files, "rank<N>.json files (fault --fr-dump)")
      ->required()
      ->check(CLI::ExistingFile);
  fr->add_flag("--json", o.json, "one JSON object");
  auto* ifs = app.add_subcommand("interfaces", "what NCCL_SOCKET_IFNAME selects on this machine");
  ifs->add_option("--cluster", o.cluster, "the interface the nodes reach each other on");
  ifs->add_option("--interfaces", o.interfaces,
                  "try a made-up list instead of this machine's (running, with an address)")
      ->delimiter(',');
  ifs->add_flag("--json", o.json, "one JSON object");
  app.require_subcommand(0, 1);

  return run_cli(
      app, argc, argv,
      [&]() -> int {
        if (doctor->parsed()) {
          const auto findings = run_doctor(env, real_machine());
          print_findings(out, findings);
          return static_cast<int>(worst(findings));
        }
        if (log->parsed()) return run_nccl_log(o, env, out);
        if (ifs->parsed()) return run_interfaces(o, env, out);
        if (fr->parsed()) return run_fr_analyze(o, out);
        return run_fault(o, env, out, err);
      },
      err);
}

int run_main(int argc, char** argv) { return run_program(argc, argv, std::cout, std::cerr); }

}  // namespace dtc::l05
