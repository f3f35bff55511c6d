// The lesson04 program: read the launch environment (your launch_env.cpp), join the job, and
// show where every rank landed. Given in full.
//
//   rank 0, stdout:   a table of every rank (rank, node, local rank, host, device, pid) and an
//                     allreduce check; with --json one JSON object on the last line instead
//   every rank, stderr: its own one-line description
#include "program.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <ostream>
#include <string>
#include <vector>

#include "dtc/cli.h"
#include "dtc/dist.h"
#include "dtc/errors.h"
#include "env_vars.h"
#include "launch_env.h"

// How torchrun is started on this build's path, with the flags it needs there (set by
// lessons/04_launch/lesson.cmake): the venv's torchrun on the primary path, Debian's with
// --redirects 2 --tee 2 on the light one.
#include "l04_config.h"

namespace dtc::l04 {
namespace {

constexpr int64_t kHostBytes = 64;  // a host name, NUL-padded, travels as 64 int64 values
constexpr int64_t kFields = 8;      // rank, local rank, local world, node, role rank, attempt,
                                    // pid, device index (-1: CPU)

struct Options {
  bool json = false;
  bool show_env = false;
  int min_ranks = 2;
  std::string backend = "gloo";
  int timeout_s = 30;
  int crash_rank = -1;
  // --hosts: print the launch commands of a multi-node job instead of joining one.
  MultiNodeJob job;
  std::string rendezvous = "static";
};

// --hosts: each node's command (your torchrun_command), one line per node, or one JSON object.
int print_commands(const Options& o, std::ostream& out) {
  MultiNodeJob job = o.job;
  job.rendezvous = o.rendezvous == "c10d" ? Rendezvous::kC10d : Rendezvous::kStatic;
  job.torchrun = DTC_L04_TORCHRUN;
  std::vector<std::string> commands;
  // At least node 0, so that an empty --hosts meets torchrun_command's own error.
  for (int node = 0; node < std::max<int>(1, static_cast<int>(job.hosts.size())); ++node) {
    commands.push_back(torchrun_command(job, node));
  }
  if (o.json) {
    print_json_line(out, {{"rendezvous", o.rendezvous},
                          {"nodes", job.hosts.size()},
                          {"nproc_per_node", job.nproc_per_node},
                          {"world_size", job.hosts.size() * job.nproc_per_node},
                          {"commands", commands}});
    return kExitOk;
  }
  fmt::print(out, "{} node(s) x {} rank(s), {} rendezvous on {}:{}; type on each node:\n\n",
             job.hosts.size(), job.nproc_per_node, o.rendezvous, job.hosts.front(), job.port);
  for (size_t node = 0; node < commands.size(); ++node) {
    fmt::print(out, "  # node {} ({})\n  {}\n\n", node, job.hosts[node], commands[node]);
  }
  return kExitOk;
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

// One row per rank: (kFields + kHostBytes,) int64.
at::Tensor my_row(const LaunchInfo& info, const torch::Device& device, const std::string& host) {
  auto row = torch::zeros({kFields + kHostBytes}, torch::kLong);
  auto a = row.accessor<int64_t, 1>();
  a[0] = info.rank;
  a[1] = info.local_rank;
  a[2] = info.local_world_size;
  a[3] = info.group_rank;
  a[4] = info.role_rank;
  a[5] = info.restart_count;
  a[6] = static_cast<int64_t>(getpid());
  a[7] = device.is_cuda() ? device.index() : -1;
  for (int64_t i = 0; i < kHostBytes - 1 && i < static_cast<int64_t>(host.size()); ++i) {
    a[kFields + i] = static_cast<unsigned char>(host[static_cast<size_t>(i)]);
  }
  return row;
}

nlohmann::json row_json(const at::Tensor& row) {
  auto a = row.accessor<int64_t, 1>();
  std::string host;
  for (int64_t i = kFields; i < kFields + kHostBytes && a[i] != 0; ++i) {
    host += static_cast<char>(a[i]);
  }
  return {{"rank", a[0]},
          {"local_rank", a[1]},
          {"local_world_size", a[2]},
          {"group_rank", a[3]},
          {"role_rank", a[4]},
          {"restart_count", a[5]},
          {"pid", a[6]},
          {"device", a[7] < 0 ? std::string("cpu") : fmt::format("cuda:{}", a[7])},
          {"host", host}};
}

void show_env(std::ostream& out, const EnvLookup& env) {
  fmt::print(out, "Launch variables seen by rank 0:\n  {:<32} {:<22} {}\n", "variable", "value",
             "set by: what it is for");
  for (const auto& v : launch_variables()) {
    const auto value = env(v.name);
    if (!value) continue;
    std::string shown = *value;
    if (shown.size() > 22) shown = shown.substr(0, 19) + "...";
    fmt::print(out, "  {:<32} {:<22} {}: {}\n", v.name, shown, v.set_by, v.meaning);
  }
  fmt::print(out, "\n");
}

int run(const Options& o, const std::vector<std::string>& args, std::ostream& out,
        std::ostream& err, const EnvLookup& env) {
  // 1. Who am I? Parse and check the launcher's variables, before touching the network.
  const LaunchInfo info = read_launch(env);
  if (o.show_env && info.rank == 0) show_env(out, env);
  require_ranks(info, o.min_ranks, args, DTC_L04_TORCHRUN);
  const int cuda_devices = static_cast<int>(torch::cuda::device_count());
  const torch::Device device = pick_device(info, cuda_devices);
  const BackendKind backend = parse_backend(o.backend);

  // 2. An elastic restart, on purpose: the first attempt loses a rank, torchrun restarts them all.
  if (o.crash_rank == info.rank && info.restart_count == 0) {
    fmt::print(err,
               "[rank {}] failing on purpose (--crash-rank {}, attempt 0); with --max-restarts "
               ">= 1 torchrun restarts every rank with TORCHELASTIC_RESTART_COUNT=1\n",
               info.rank, o.crash_rank);
    return kExitFailure;
  }

  // 3. Join the job. One rank needs no rendezvous: an in-process store will do.
  const std::chrono::milliseconds timeout(std::chrono::seconds(o.timeout_s));
  c10::intrusive_ptr<Comm> comm;
  if (info.world_size == 1) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    comm = new_comm(store, 0, 1, backend, timeout);
  } else {
    DistOptions options;
    options.backend = backend;
    options.timeout = timeout;
    comm = init_distributed(info, options).comm;  // a LaunchInfo is a LaunchEnv
  }
  const std::string host = host_name();
  fmt::print(err, "[rank {}] {}, device {}, host {}, pid {}\n", info.rank, info.describe(),
             device.str(), host, getpid());
  err.flush();

  // 4. Check it: allreduce(SUM) of rank + 1 over N ranks is N (N + 1) / 2.
  const torch::Device comm_device = backend == BackendKind::kNccl ? device : torch::kCPU;
  std::vector<at::Tensor> sum{torch::full({1}, info.rank + 1, torch::kLong).to(comm_device)};
  comm->allreduce(sum)->wait();
  const int64_t got = sum[0].cpu().item<int64_t>();
  const int64_t n = info.world_size;
  const int64_t expected = n * (n + 1) / 2;

  // 5. Everyone's place: allgather one row per rank; (world, kFields + kHostBytes).
  std::vector<at::Tensor> mine{my_row(info, device, host).to(comm_device)};
  std::vector<std::vector<at::Tensor>> all(1);
  for (int r = 0; r < info.world_size; ++r) all[0].push_back(torch::empty_like(mine[0]));
  comm->allgather(all, mine)->wait();
  if (info.rank != 0) return got == expected ? kExitOk : kExitFailure;

  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& row : all[0]) ranks.push_back(row_json(row.cpu()));
  if (o.json) {
    print_json_line(out, {{"launcher", launcher_name(info.launcher)},
                          {"world_size", info.world_size},
                          {"nodes", info.group_world_size},
                          {"restart_count", info.restart_count},
                          {"max_restarts", info.max_restarts},
                          {"run_id", info.run_id},
                          {"master_addr", info.master_addr},
                          {"master_port", info.master_port},
                          {"use_agent_store", info.use_agent_store},
                          {"store_prefix", info.store_prefix()},
                          {"backend", o.backend},
                          {"allreduce_sum", got},
                          {"expected_sum", expected},
                          {"ranks", ranks}});
  } else {
    fmt::print(out, "lesson04: {} rank(s) on {} node(s) via {}, attempt {} (max restarts {})\n",
               info.world_size, info.group_world_size, launcher_name(info.launcher),
               info.restart_count, info.max_restarts);
    fmt::print(out, "  store {}:{} ({}), keys under '{}'\n\n", info.master_addr, info.master_port,
               info.use_agent_store ? "hosted by torchrun's agent" : "hosted by rank 0",
               info.store_prefix());
    fmt::print(out, "  {:>4} {:>4} {:>10} {:<16} {:<8} {:>8}\n", "rank", "node", "local", "host",
               "device", "pid");
    for (const auto& r : ranks) {
      fmt::print(out, "  {:>4} {:>4} {:>10} {:<16} {:<8} {:>8}\n", r["rank"].get<int64_t>(),
                 r["group_rank"].get<int64_t>(),
                 fmt::format("{}/{}", r["local_rank"].get<int64_t>(),
                             r["local_world_size"].get<int64_t>()),
                 r["host"].get<std::string>(), r["device"].get<std::string>(),
                 r["pid"].get<int64_t>());
    }
    fmt::print(out,
               "\n  allreduce(SUM) of rank+1 over {} ranks: {} (closed form N(N+1)/2 = {}) {}\n", n,
               got, expected, got == expected ? "ok" : "WRONG");
  }
  return got == expected ? kExitOk : kExitFailure;
}

}  // namespace

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
                const EnvLookup& env) {
  CLI::App app{"lesson04: read the launch environment, join the job, and show every rank's place",
               "lesson04"};
  Options o;
  app.add_flag("--json", o.json, "rank 0 prints one JSON object on the last line of stdout");
  app.add_flag("--show-env", o.show_env, "rank 0 prints every launch variable it received");
  app.add_option("--min-ranks", o.min_ranks, "the fewest ranks to run with")
      ->check(positive_count("--min-ranks 2"))
      ->capture_default_str();
  app.add_option("--backend", o.backend, "collectives: gloo, or nccl on GPU nodes")
      ->check(CLI::IsMember({"gloo", "nccl"}))
      ->capture_default_str();
  app.add_option("--timeout-s", o.timeout_s, "seconds a store read or collective may wait")
      ->check(CLI::Range(1, 3600))
      ->capture_default_str();
  app.add_option("--crash-rank", o.crash_rank,
                 "this rank exits with an error on the first attempt (watch torchrun restart)")
      ->check(non_negative_count("--crash-rank 1"));
  // The multi-node launch (README section 7): commands to print, nothing to join. Their values
  // reach torchrun_command unchecked, which is yours to check (its UsageErrors).
  auto* hosts = app.add_option("--hosts", o.job.hosts,
                               "print each node's torchrun command for these nodes (comma-"
                               "separated, the store's host first) and exit")
                    ->delimiter(',');
  app.add_option("--nproc-per-node", o.job.nproc_per_node, "with --hosts: ranks per node")
      ->needs(hosts)
      ->capture_default_str();
  app.add_option("--port", o.job.port, "with --hosts: the store's port on the first host")
      ->needs(hosts)
      ->capture_default_str();
  app.add_option("--rdzv", o.rendezvous, "with --hosts: static (node ranks) or c10d")
      ->needs(hosts)
      ->check(one_of({"static", "c10d"}, "rendezvous"))
      ->capture_default_str();
  app.add_option("--job-id", o.job.job_id, "with --hosts --rdzv c10d: the rendezvous id")
      ->needs(hosts)
      ->capture_default_str();
  app.add_option("program", o.job.program,
                 "with --hosts: the program every rank runs and its arguments, after --");
  std::vector<std::string> args(argv, argv + argc);
  return run_cli(
      app, argc, argv,
      [&] {
        if (!o.job.hosts.empty() || !o.job.program.empty()) return print_commands(o, out);
        return run(o, args, out, err, env);
      },
      err);
}

int run_main(int argc, char** argv) { return run_program(argc, argv, std::cout, std::cerr); }

}  // namespace dtc::l04
