// The lesson05 program: `doctor`, `fault --case C` and `nccl-log FILE`. Given in full.
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

#include <chrono>
#include <fstream>
#include <ostream>
#include <string>
#include <vector>

#include "debug_aids.h"
#include "doctor.h"
#include "dtc/cli.h"
#include "dtc/dist.h"
#include "dtc/errors.h"
#include "dtc/todo.h"
#include "nccl_log.h"

namespace dtc::l05 {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string fault = "none";
  int timeout_ms = 5000;
  bool no_check = false;
  std::string ifname = "nosuch0";
  std::vector<std::string> logs;
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
  CheckedComm checked(store, comm, timeout, !o.no_check);

  std::vector<at::Tensor> a{torch::ones({o.fault == "shape-mismatch" && rank == 1 ? 8 : 4})};
  std::vector<at::Tensor> b{torch::full({2}, static_cast<float>(rank))};
  try {
    if (!(o.fault == "skip-collective" && rank == 1)) checked.allreduce(a);
    checked.broadcast(b, 0);
  } catch (const CollectiveMismatchError& e) {
    return diagnosed(err, rank, e.what(), t0);
  } catch (const MissingRanksError& e) {
    return diagnosed(err, rank, e.what(), t0);
  } catch (const TodoError&) {
    throw;  // an unfinished exercise is not a fault: run_cli reports it (exit 3)
  } catch (const std::exception& e) {
    // --no-check: what the library itself says (a timeout, a size error, or worse: nothing).
    return diagnosed(err, rank,
                     fmt::format("the collective failed without fingerprints: {}",
                                 std::string(e.what()).substr(0, 400)),
                     t0);
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
  return kExitOk;
}

int run_fault(const Options& o, const EnvLookup& env, std::ostream& out, std::ostream& err) {
  const auto t0 = Clock::now();
  if (o.fault == "port-in-use") return fault_port_in_use(o, out, err, t0);
  if (o.fault == "bad-ifname") return fault_bad_ifname(o, env, err, t0);
  return fault_distributed(o, env, out, err, t0);
}

int run_nccl_log(const Options& o, std::ostream& out) {
  for (const auto& path : o.logs) {
    std::ifstream in(path);
    if (!in) throw UsageError("nccl-log", "cannot read '" + path + "'", "give a log file path");
    out << "== " << path << "\n";
    print_nccl_summary(out, parse_nccl_log(in));
  }
  return kExitOk;
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
                             "missing-rank", "port-in-use", "bad-ifname"}))
      ->capture_default_str();
  fault->add_flag("--no-check", o.no_check, "no fingerprints: see what the library says alone");
  fault->add_option("--ifname", o.ifname, "the interface name for --case bad-ifname")
      ->capture_default_str();
  fault->add_option("--timeout-ms", o.timeout_ms, "how long a rank waits for the others")
      ->check(CLI::Range(100, 600000));
  auto* log = app.add_subcommand("nccl-log", "summarise NCCL_DEBUG=INFO logs");
  log->add_option("files", o.logs, "log files")->required()->check(CLI::ExistingFile);
  app.require_subcommand(0, 1);

  return run_cli(
      app, argc, argv,
      [&]() -> int {
        if (doctor->parsed()) {
          const auto findings = run_doctor(env, real_machine());
          print_findings(out, findings);
          return static_cast<int>(worst(findings));
        }
        if (log->parsed()) return run_nccl_log(o, out);
        return run_fault(o, env, out, err);
      },
      err);
}

}  // namespace dtc::l05
