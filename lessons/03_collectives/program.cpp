// The lesson03 program: the process model of the job, the collectives tour, the rank grid with
// its subgroups, and the ring allreduce compared with gloo's. Given in full; the collectives it
// calls are yours, in collectives.cpp.
//
//   torchrun --standalone --nproc_per_node=4 --no_python build/bin/lesson03 --tp 2
#include "program.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <iostream>
#include <ostream>
#include <string>
#include <vector>

#include "collectives.h"
#include "dtc/cli.h"
#include "dtc/compare.h"
#include "dtc/dist.h"
#include "dtc/errors.h"

namespace dtc::l03 {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// "[1, 1, 1, 1]", or the first values and "..." for a long tensor.
std::string show(const at::Tensor& t) {
  if (!t.defined()) return "(none: not the root)";
  auto flat = t.reshape({-1}).to(at::kDouble);
  std::vector<std::string> parts;
  const int64_t shown = std::min<int64_t>(flat.numel(), 6);
  for (int64_t i = 0; i < shown; ++i) parts.push_back(fmt::format("{:g}", flat[i].item<double>()));
  if (flat.numel() > shown) parts.push_back("...");
  return fmt::format("{} [{}]", c10::str(t.sizes()), fmt::join(parts, ", "));
}

bool matches(const at::Tensor& got, const at::Tensor& expected) {
  return got.defined() && compare_tensors(got, expected, kExact).ok;
}

// One line of the tour: what this rank got, what the closed form says, and whether they agree.
struct TourRow {
  std::string name;
  std::string got;       // rank 0's result, for the table
  std::string expected;  // the closed form, in words
  bool ok = false;       // on this rank
};

std::vector<TourRow> run_tour(Comm& comm, c10d::Store& store) {
  const int w = comm.getSize();
  const int r = comm.getRank();
  const int64_t n = 4;
  const float sum = w * (w + 1) / 2.0f;  // 1 + 2 + ... + W
  std::vector<TourRow> rows;

  auto b = tour_broadcast(comm, /*root=*/w - 1, n);
  rows.push_back({"broadcast", show(b), fmt::format("root {} holds full(n, {})", w - 1, w),
                  matches(b, torch::full({n}, static_cast<float>(w)))});

  auto a = tour_allreduce(comm, n);
  rows.push_back({"allreduce", show(a), fmt::format("sum of r+1 = W(W+1)/2 = {:g}", sum),
                  matches(a, torch::full({n}, sum))});

  auto g = tour_allgather(comm, 2);
  auto g_expected = torch::arange(w, torch::kFloat).unsqueeze(1).expand({w, 2}).contiguous();
  rows.push_back({"allgather", show(g), "row i = full(n, i)", matches(g, g_expected)});

  auto red = tour_reduce(comm, /*root=*/0, n);
  rows.push_back({"reduce", show(red), fmt::format("root 0 only: {:g}", sum),
                  r == 0 ? matches(red, torch::full({n}, sum)) : !red.defined()});

  const int64_t chunk = 2;
  auto t = tour_alltoall(comm, chunk);
  auto t_expected = torch::empty({w * chunk});
  for (int j = 0; j < w; ++j) t_expected.narrow(0, j * chunk, chunk).fill_(100.0 * j + r);
  rows.push_back(
      {"alltoall", show(t), "chunk j = 100 j + r (from j, for r)", matches(t, t_expected)});

  auto s = tour_send_recv(comm, n);
  rows.push_back({"send/recv", show(s), "from the left neighbour: full(n, (r-1) mod W)",
                  matches(s, torch::full({n}, static_cast<float>((r - 1 + w) % w)))});

  const int arrived = tour_barrier(comm, store, "lesson03/tour/");
  rows.push_back({"barrier", fmt::format("{} keys seen", arrived),
                  fmt::format("all {} store keys written", w), arrived == w});
  return rows;
}

// Sums a vector of 0/1 flags over all ranks: how many ranks passed each check.
std::vector<int64_t> count_ok(Comm& comm, const std::vector<bool>& flags) {
  auto t = torch::zeros({static_cast<int64_t>(flags.size())}, torch::kLong);
  for (size_t i = 0; i < flags.size(); ++i) t[static_cast<int64_t>(i)] = flags[i] ? 1 : 0;
  std::vector<at::Tensor> v{t};
  comm.allreduce(v)->wait();
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
}

// Every rank's (rank, local_rank, node, pid), gathered: one process per rank, each its own pid.
std::vector<std::vector<int64_t>> gather_processes(Comm& comm, const LaunchEnv& env) {
  const int w = comm.getSize();
  std::vector<at::Tensor> in{
      torch::tensor({static_cast<int64_t>(comm.getRank()), static_cast<int64_t>(env.local_rank),
                     static_cast<int64_t>(env.group_rank), static_cast<int64_t>(::getpid())},
                    torch::kLong)};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int i = 0; i < w; ++i) out[0].push_back(torch::empty({4}, torch::kLong));
  comm.allgather(out, in)->wait();
  std::vector<std::vector<int64_t>> rows;
  for (const auto& t : out[0])
    rows.push_back(
        {t[0].item<int64_t>(), t[1].item<int64_t>(), t[2].item<int64_t>(), t[3].item<int64_t>()});
  return rows;
}

}  // namespace

int run_demo(const DemoOptions& o, const LaunchEnv& env,
             const c10::intrusive_ptr<c10d::Store>& store, Comm& world, std::ostream& out) {
  const int w = world.getSize();
  const int rank = world.getRank();
  const RankGrid grid = make_grid(w, std::max(1, w / (o.tp * o.pp)), o.tp, o.pp);

  // --- 1. the process model ----------------------------------------------------------------
  const auto processes = gather_processes(world, env);

  // --- 2. the tour ---------------------------------------------------------------------------
  const std::vector<TourRow> tour = run_tour(world, *store);

  // --- 3. the rank grid: coordinates, groups, and one allreduce in each subgroup -------------
  const GridGroups groups = build_grid_groups(store, grid, rank, o.timeout);
  bool grid_ok = true;
  nlohmann::json grid_checks = nlohmann::json::object();
  for (Axis axis : {Axis::kDp, Axis::kTp, Axis::kPp}) {
    Comm* sub = (axis == Axis::kDp ? groups.dp : axis == Axis::kTp ? groups.tp : groups.pp).get();
    const std::vector<int> members = group_ranks(grid, rank, axis);
    const int coord = axis == Axis::kDp   ? groups.coord.dp
                      : axis == Axis::kTp ? groups.coord.tp
                                          : groups.coord.pp;
    // Each member contributes its global rank: the group's sum is the sum of its members.
    std::vector<at::Tensor> t{torch::full({1}, static_cast<float>(rank))};
    sub->allreduce(t)->wait();
    int expected = 0;
    for (int m : members) expected += m;
    const bool ok = sub->getSize() == static_cast<int>(members.size()) && sub->getRank() == coord &&
                    t[0].item<float>() == expected;
    grid_ok = grid_ok && ok;
  }

  // --- 4. the ring allreduce against gloo's allreduce -----------------------------------------
  // A generator of this rank's own (thread-ranks in the tests must not share the global one).
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed * 1000 + static_cast<uint64_t>(rank));
  auto ring = at::randn({o.numel}, gen);  // (numel,), different data on every rank
  auto reference = ring.clone();
  world.barrier()->wait();
  auto start = Clock::now();
  ring_allreduce(world, ring);
  const double ring_ms = ms_since(start);
  world.barrier()->wait();
  start = Clock::now();
  std::vector<at::Tensor> ref{reference};
  world.allreduce(ref)->wait();
  const double gloo_ms = ms_since(start);
  const auto ring_cmp = compare_tensors(ring, reference, kFp32Op, "ring allreduce vs gloo");
  const double max_diff = o.numel > 0 ? (ring - reference).abs().max().item<double>() : 0.0;

  // --- how many ranks passed each check --------------------------------------------------------
  std::vector<bool> flags;
  for (const auto& row : tour) flags.push_back(row.ok);
  flags.push_back(grid_ok);
  flags.push_back(ring_cmp.ok);
  const std::vector<int64_t> passed = count_ok(world, flags);
  bool all_ok = true;
  for (int64_t p : passed) all_ok = all_ok && p == w;
  if (rank != 0) return all_ok ? kExitOk : kExitFailure;

  // --- rank 0 reports ------------------------------------------------------------------------
  std::vector<int64_t> chunk_sizes;
  for (const auto& c : ring_chunks(o.numel, w)) chunk_sizes.push_back(c.size);
  if (o.json) {
    nlohmann::json j;
    j["world"] = w;
    j["backend"] = "gloo";
    j["torch"] = torch_version();
    j["processes"] = nlohmann::json::array();
    for (const auto& p : processes) {
      j["processes"].push_back(
          {{"rank", p[0]}, {"local_rank", p[1]}, {"node", p[2]}, {"pid", p[3]}});
    }
    j["tour"] = nlohmann::json::object();
    for (size_t i = 0; i < tour.size(); ++i) j["tour"][tour[i].name] = passed[i] == w;
    j["grid"] = {{"dp", grid.dp},
                 {"tp", grid.tp},
                 {"pp", grid.pp},
                 {"groups",
                  {{"dp", all_groups(grid, Axis::kDp)},
                   {"tp", all_groups(grid, Axis::kTp)},
                   {"pp", all_groups(grid, Axis::kPp)}}},
                 {"ok", passed[tour.size()] == w}};
    j["ring"] = {{"numel", o.numel},         {"chunks", chunk_sizes},
                 {"max_abs_diff", max_diff}, {"ok", passed[tour.size() + 1] == w},
                 {"ring_ms", ring_ms},       {"gloo_ms", gloo_ms}};
    j["ok"] = all_ok;
    print_json_line(out, j);
    return all_ok ? kExitOk : kExitFailure;
  }

  fmt::print(out, "Lesson 03: process groups and collectives: {} ranks, gloo, LibTorch {}\n", w,
             torch_version());
  fmt::print(out, "store: {}:{}{}, this attempt's keys under '{}'\n\n", env.master_addr,
             env.master_port,
             env.use_agent_store ? " (hosted by torchrun's agent)" : " (rank 0 hosts it)",
             env.store_prefix());
  fmt::print(out, "One process per rank (on a GPU node each would call set_device(local_rank)):\n");
  fmt::print(out, "  {:>4}  {:>10}  {:>4}  {:>8}  {}\n", "rank", "local_rank", "node", "pid",
             "device");
  for (const auto& p : processes) {
    fmt::print(out, "  {:>4}  {:>10}  {:>4}  {:>8}  cpu (cuda:{} on a GPU node)\n", p[0], p[1],
               p[2], p[3], p[1]);
  }
  fmt::print(out, "\nCollectives tour (each rank checks its own result; rank 0's shown):\n");
  fmt::print(out, "  {:<10} {:<36} {:<46} {}\n", "collective", "rank 0 got", "closed form",
             "ranks ok");
  for (size_t i = 0; i < tour.size(); ++i) {
    fmt::print(out, "  {:<10} {:<36} {:<46} {}/{}\n", tour[i].name, tour[i].got, tour[i].expected,
               passed[i], w);
  }
  fmt::print(out, "\nRank grid dp {} x tp {} x pp {} (Megatron order: tp fastest, then dp, pp):\n",
             grid.dp, grid.tp, grid.pp);
  for (Axis axis : {Axis::kTp, Axis::kDp, Axis::kPp}) {
    std::vector<std::string> text;
    for (const auto& g : all_groups(grid, axis))
      text.push_back(fmt::format("[{}]", fmt::join(g, ",")));
    fmt::print(out, "  {} groups: {}\n", axis_name(axis), fmt::join(text, " "));
  }
  fmt::print(out,
             "  subgroups built with dtc::new_subgroup; one allreduce in each: {}/{} ranks ok\n",
             passed[tour.size()], w);
  fmt::print(out, "\nRing allreduce of {} floats (chunks {}):\n", o.numel,
             fmt::join(chunk_sizes, ", "));
  fmt::print(out, "  max |ring - gloo| = {:.3g} ({}), {}/{} ranks ok\n", max_diff, kFp32Op.why,
             passed[tour.size() + 1], w);
  fmt::print(out, "  one call each: ring {:.2f} ms, gloo {:.2f} ms (bench_collectives measures)\n",
             ring_ms, gloo_ms);
  fmt::print(out, "\n{}\n",
             all_ok ? "all results match their closed forms"
                    : "SOME RESULTS ARE WRONG: see the 'ranks ok' columns");
  return all_ok ? kExitOk : kExitFailure;
}

int run_program(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
                const EnvLookup& env_lookup) {
  CLI::App app{
      "Lesson 03: process groups and collectives. Runs the collectives tour, builds the DP x TP "
      "x PP rank grid's subgroups and compares your ring allreduce with gloo's. Needs 2+ ranks: "
      "start it with torchrun.",
      "lesson03"};
  DemoOptions o;
  int64_t timeout_ms = o.timeout.count();
  std::string backend = "gloo";
  app.add_option("--tp", o.tp, "tensor-parallel degree of the rank grid")
      ->check(positive_count("--tp 2"))
      ->capture_default_str();
  app.add_option("--pp", o.pp, "pipeline-parallel degree of the rank grid (dp = world / tp / pp)")
      ->check(positive_count("--pp 1"))
      ->capture_default_str();
  app.add_option("--numel", o.numel, "elements of the ring allreduce")
      ->check(non_negative_count("--numel 1000"))
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed of the ring allreduce's inputs")->capture_default_str();
  app.add_option("--timeout", timeout_ms, "milliseconds a collective may wait before it fails")
      ->check(positive_count("--timeout 30000"))
      ->capture_default_str();
  app.add_option("--backend", backend, "collectives: gloo (this lesson's tensors live on the CPU)")
      ->check(CLI::IsMember({"gloo", "nccl"}))
      ->capture_default_str();
  app.add_flag("--json", o.json, "rank 0 prints one JSON object on the last line of stdout");

  const std::string program = argc > 0 ? argv[0] : "lesson03";
  return run_cli(
      app, argc, argv,
      [&] {
        o.timeout = std::chrono::milliseconds(timeout_ms);
        if (parse_backend(backend) == BackendKind::kNccl) {
          throw UsageError("--backend",
                           "lesson03 runs its collectives on CPU tensors, which NCCL cannot move",
                           "use --backend gloo here; lesson 05 runs NCCL on GPU tensors");
        }
        const LaunchEnv env = read_launch_env(env_lookup);
        require_world_size(env, 2, program);
        // The grid is checked before any connection: a bad --tp fails at once, on every rank.
        make_grid(env.world_size, std::max(1, env.world_size / (o.tp * o.pp)), o.tp, o.pp);
        DistOptions dist_options;
        dist_options.timeout = o.timeout;
        Distributed dist = init_distributed(env, dist_options);
        return run_demo(o, env, dist.store, *dist.comm, out);
      },
      err);
}

int run_main(int argc, char** argv) { return run_program(argc, argv, std::cout, std::cerr); }

}  // namespace dtc::l03
