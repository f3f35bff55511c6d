// bench_collectives: allreduce bandwidth in the style of NVIDIA's nccl-tests, for lesson 03's
// ring allreduce (the reference solution's, built from send/recv) next to gloo's own allreduce.
//
//   torchrun --standalone --nproc_per_node=2 --no_python build/bin/bench_collectives
//                                                        # 1 KiB .. 64 MiB, x2 per row
//   ... --nproc_per_node=4 ... build/bin/bench_collectives --iters 10 --json
//
// Columns, as nccl-tests prints them: size (bytes), count (float32 elements), time (us per
// call, the slowest rank's average), algbw = size / time, busbw = algbw * 2(n-1)/n (the bytes
// each rank's link really carries in a ring allreduce, so that the number is comparable across
// rank counts), #wrong (elements that differ from the exact expected sum, over all ranks and
// iterations). Every iteration starts from the same input, x[i] = (rank + 1) * (i % 13 + 1),
// whose sum W(W+1)/2 * (i % 13 + 1) is an integer below 2^24: exact in float32, so any wrong
// element is a real error. The program exits with 1 when #wrong is not 0 anywhere.
#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <iostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "collectives.h"
#include "dtc/cli.h"
#include "dtc/cost.h"
#include "dtc/dist.h"
#include "dtc/errors.h"
#include "dtc/launch.h"

namespace {

using Clock = std::chrono::steady_clock;
using dtc::Comm;

// "1K" -> 1024, "64M" -> 67108864, "4096" -> 4096 (binary units, as nccl-tests' -b/-e).
int64_t parse_bytes(const std::string& text, const char* flag) {
  size_t used = 0;
  long long value = -1;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string suffix = text.substr(used);
  int64_t scale = 1;
  if (suffix == "K" || suffix == "k") scale = int64_t{1} << 10;
  if (suffix == "M" || suffix == "m") scale = int64_t{1} << 20;
  if (suffix == "G" || suffix == "g") scale = int64_t{1} << 30;
  if (used == 0 || value < 1 || (!suffix.empty() && scale == 1) || value * scale < 4) {
    throw dtc::UsageError(
        flag, fmt::format("'{}' is not a size of at least 4 bytes", text),
        fmt::format("write bytes, or a number with K, M or G (binary): {} 64M", flag));
  }
  return value * scale;
}

struct Measured {
  double time_us = 0;  // the slowest rank's mean time per call
  int64_t wrong = 0;   // wrong elements, all ranks, all iterations
};

// Runs `op` on a fresh copy of the input for warm-up + iters calls, timing each call between two
// barriers (so that every call starts together) and counting wrong elements after each.
template <class Op>
Measured measure(Comm& comm, const at::Tensor& input, const at::Tensor& expected, int warmup,
                 int iters, Op op) {
  auto buf = torch::empty_like(input);
  double total_s = 0;
  int64_t wrong = 0;
  for (int i = 0; i < warmup + iters; ++i) {
    buf.copy_(input);  // outside the timed region
    comm.barrier()->wait();
    const auto start = Clock::now();
    op(buf);
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    if (i >= warmup) {
      total_s += s;
      wrong += buf.ne(expected).sum().item<int64_t>();
    }
  }
  // The slowest rank sets the pace; wrong elements add up over ranks.
  std::vector<at::Tensor> t{torch::tensor({total_s / iters}, torch::kDouble)};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  comm.allreduce(t, max)->wait();
  std::vector<at::Tensor> w{torch::tensor({wrong}, torch::kLong)};
  comm.allreduce(w)->wait();
  return {t[0].item<double>() * 1e6, w[0].item<int64_t>()};
}

struct Options {
  std::string min_bytes = "1K";
  std::string max_bytes = "64M";
  int factor = 2;
  int warmup = 5;
  int iters = 20;
  int64_t timeout_ms = 120000;
  bool json = false;
};

int run(const Options& o, const std::string& program, std::ostream& out) {
  const int64_t min_b = parse_bytes(o.min_bytes, "--min-bytes");
  const int64_t max_b = parse_bytes(o.max_bytes, "--max-bytes");
  if (max_b < min_b) {
    throw dtc::UsageError("--max-bytes", "is smaller than --min-bytes",
                          "give a range, e.g. --min-bytes 1K --max-bytes 64M");
  }
  const dtc::LaunchEnv env = dtc::read_launch_env();
  dtc::require_world_size(env, 2, program);
  dtc::DistOptions dist_options;
  dist_options.timeout = std::chrono::milliseconds(o.timeout_ms);
  dtc::Distributed dist = dtc::init_distributed(env, dist_options);
  Comm& comm = *dist.comm;
  const int w = comm.getSize();
  const int rank = comm.getRank();
  const double bus_factor = 2.0 * (w - 1) / w;  // nccl-tests, allreduce
  const bool print = rank == 0 && !o.json;

  if (print) {
    fmt::print(out,
               "# bench_collectives: allreduce (sum, float32) on {} ranks, gloo, LibTorch {}\n", w,
               dtc::torch_version());
    fmt::print(out, "# warm-up {}, iterations {}; busbw = algbw * 2(n-1)/n = algbw * {:.3f}\n#\n",
               o.warmup, o.iters, bus_factor);
    fmt::print(out, "# {:>10} {:>10}   {:^38}   {:^38}\n", "", "", "ring (lesson 03, send/recv)",
               "gloo allreduce");
    fmt::print(out, "# {:>10} {:>10}   {:>9} {:>8} {:>8} {:>8}   {:>9} {:>8} {:>8} {:>8}\n", "size",
               "count", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong");
    fmt::print(out, "# {:>10} {:>10}   {:>9} {:>8} {:>8} {:>8}   {:>9} {:>8} {:>8} {:>8}\n", "(B)",
               "(elements)", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
  }

  nlohmann::json rows = nlohmann::json::array();
  int64_t total_wrong = 0;
  double last_ring_bus = 0, last_gloo_bus = 0;
  int64_t last_bytes = 0;
  std::vector<std::pair<double, double>> ring_points;  // (bytes, seconds), for the alpha-beta fit
  for (int64_t bytes = min_b; bytes <= max_b; bytes *= o.factor) {
    const int64_t count = bytes / 4;
    // x[i] = (rank + 1)(i % 13 + 1); the sum over ranks is W(W+1)/2 (i % 13 + 1), exactly.
    auto pattern = torch::arange(count, torch::kLong).remainder(13).add(1).to(torch::kFloat);
    auto input = pattern * static_cast<float>(rank + 1);
    auto expected = pattern * static_cast<float>(w * (w + 1) / 2);
    const Measured ring = measure(comm, input, expected, o.warmup, o.iters,
                                  [&](at::Tensor& buf) { dtc::l03::ring_allreduce(comm, buf); });
    const Measured gloo = measure(comm, input, expected, o.warmup, o.iters, [&](at::Tensor& buf) {
      std::vector<at::Tensor> v{buf};
      comm.allreduce(v)->wait();
    });
    const double real_bytes = static_cast<double>(count) * 4;
    const double ring_alg = real_bytes / (ring.time_us * 1e-6) / 1e9;
    const double gloo_alg = real_bytes / (gloo.time_us * 1e-6) / 1e9;
    total_wrong += ring.wrong + gloo.wrong;
    ring_points.emplace_back(real_bytes, ring.time_us * 1e-6);
    last_ring_bus = ring_alg * bus_factor;
    last_gloo_bus = gloo_alg * bus_factor;
    last_bytes = count * 4;
    if (print) {
      fmt::print(out,
                 "  {:>10} {:>10}   {:>9.1f} {:>8.3f} {:>8.3f} {:>8}   {:>9.1f} {:>8.3f} "
                 "{:>8.3f} {:>8}\n",
                 count * 4, count, ring.time_us, ring_alg, last_ring_bus, ring.wrong, gloo.time_us,
                 gloo_alg, last_gloo_bus, gloo.wrong);
      out.flush();
    }
    rows.push_back({{"size", count * 4},
                    {"count", count},
                    {"ring",
                     {{"time_us", ring.time_us},
                      {"algbw", ring_alg},
                      {"busbw", last_ring_bus},
                      {"wrong", ring.wrong}}},
                    {"gloo",
                     {{"time_us", gloo.time_us},
                      {"algbw", gloo_alg},
                      {"busbw", last_gloo_bus},
                      {"wrong", gloo.wrong}}}});
    if (bytes > max_b / o.factor) break;  // the next size would pass max (and avoid overflow)
  }
  const double ratio = last_gloo_bus > 0 ? last_ring_bus / last_gloo_bus : 0;
  // The alpha-beta model T = 2(W-1) alpha + 2(W-1)/W S/B, fitted to the ring's times.
  nlohmann::json fit = nullptr;
  std::string fit_line;
  try {
    const dtc::AlphaBeta m = dtc::fit_ring_allreduce(ring_points, w);
    fit = {{"alpha_us", m.alpha_s * 1e6},
           {"bandwidth_gbs", m.bandwidth / 1e9},
           {"crossover_bytes", m.crossover_bytes}};
    fit_line = fmt::format(
        "# ring fit, T = 2(W-1) alpha + 2(W-1)/W S/B: alpha {:.1f} us a step, B {:.3f} GB/s; "
        "latency-bound below S = alpha W B = {:.0f} B\n",
        m.alpha_s * 1e6, m.bandwidth / 1e9, m.crossover_bytes);
  } catch (const std::invalid_argument& e) {
    fit_line = fmt::format("# ring fit: none ({})\n", e.what());
  }
  if (print) {
    fmt::print(out, "# busbw at {} B: ring {:.3f} GB/s, gloo {:.3f} GB/s: ring / gloo = {:.2f}\n",
               last_bytes, last_ring_bus, last_gloo_bus, ratio);
    fmt::print(out, "{}", fit_line);
    fmt::print(out, "# #wrong in all: {} {}\n", total_wrong, total_wrong == 0 ? "OK" : "FAILED");
  }
  if (rank == 0 && o.json) {
    dtc::print_json_line(out, {{"world", w},
                               {"bus_factor", bus_factor},
                               {"warmup", o.warmup},
                               {"iters", o.iters},
                               {"rows", rows},
                               {"busbw_ratio_at_max", ratio},
                               {"alpha_beta", fit},
                               {"wrong", total_wrong}});
  }
  return total_wrong == 0 ? dtc::kExitOk : dtc::kExitFailure;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "nccl-tests style allreduce benchmark: lesson 03's ring allreduce vs gloo's. "
      "Run it under torchrun with 2 or more ranks.",
      "bench_collectives"};
  Options o;
  app.add_option("--min-bytes", o.min_bytes, "smallest size (K, M, G: binary)")
      ->capture_default_str();
  app.add_option("--max-bytes", o.max_bytes, "largest size")->capture_default_str();
  app.add_option("--factor", o.factor, "size multiplier per row")
      ->check(CLI::Range(2, 1024))
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed calls per size")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--iters", o.iters, "timed calls per size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--timeout", o.timeout_ms, "milliseconds a collective may wait")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--json", o.json, "rank 0 prints one JSON object instead of the table");
  const std::string program = argc > 0 ? argv[0] : "bench_collectives";
  return dtc::run_cli(
      app, argc, argv, [&] { return run(o, program, std::cout); }, std::cerr);
}
