#include "dtc/ranks.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dtc/dist.h"
#include "dtc/local_comm.h"

namespace dtc {

bool ranks_forced_to_gloo() {
  const char* forced = std::getenv("DTC_RANKS_TRANSPORT");
  return forced != nullptr && std::string(forced) == "gloo";
}

void run_ranks(int world, const std::function<void(RankContext&)>& body,
               std::chrono::milliseconds timeout, RanksTransport transport) {
  if (world < 1) throw std::invalid_argument(fmt::format("run_ranks: world {} < 1", world));
  if (ranks_forced_to_gloo()) transport = RanksTransport::kGloo;
  const bool local = transport == RanksTransport::kLocal;
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(timeout);

  std::mutex mu;
  std::condition_variable done_cv;
  int done = 0;
  std::vector<std::string> errors(world);
  std::vector<char> finished(world, 0);

  std::vector<std::thread> threads;
  threads.reserve(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      std::string error;
      try {
        local_transport_on_this_thread() = local;
        RankContext ctx;
        ctx.rank = r;
        ctx.world = world;
        ctx.store = store;
        ctx.comm = new_comm(store, r, world, BackendKind::kGloo, timeout);
        // Every rank connected before any body runs: a body that returns at once would
        // otherwise tear its process group down while a peer is still connecting, and that
        // peer would fail with gloo's "Connection closed by peer" instead of its own error.
        ctx.comm->barrier()->wait();
        body(ctx);
      } catch (const c10::Error& e) {
        error = e.what_without_backtrace();  // LibTorch's 12-frame backtrace helps no learner
      } catch (const std::exception& e) {
        error = e.what();
      } catch (...) {
        error = "unknown exception";
      }
      std::lock_guard<std::mutex> lock(mu);
      errors[r] = std::move(error);
      finished[r] = 1;
      ++done;
      done_cv.notify_all();
    });
  }

  {
    // The watchdog guards against hangs, not slow machines. Once one rank has returned, the
    // others are at most one collective timeout from returning too (their peer is gone): a rank
    // still running 2 x timeout + min(5 x timeout, 10 s) later is stuck outside a collective.
    // While no rank has returned, all are still working (a busy machine, a long test): only a
    // cap far beyond any test's length applies.
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    const auto after_first =
        2 * timeout + std::min<std::chrono::milliseconds>(5 * timeout, std::chrono::seconds(10));
    const auto cap =
        std::max<std::chrono::milliseconds>(10 * timeout, std::chrono::seconds(60)) + after_first;
    std::unique_lock<std::mutex> lock(mu);
    std::optional<clock::time_point> first_done;
    while (done < world) {
      if (done > 0 && !first_done) first_done = clock::now();
      const auto deadline =
          first_done ? std::min(*first_done + after_first, start + cap) : start + cap;
      if (done_cv.wait_until(lock, deadline,
                             [&] { return done == world || (done > 0 && !first_done); })) {
        continue;
      }
      std::string stuck;
      for (int r = 0; r < world; ++r) {
        if (!finished[r]) stuck += fmt::format(" {}", r);
      }
      const auto elapsed =
          std::chrono::duration_cast<std::chrono::milliseconds>(clock::now() - start).count();
      std::fprintf(stderr,
                   "FATAL: run_ranks: rank(s)%s still running %lld ms after the start%s, past the "
                   "%lld ms collective timeout. A rank is stuck outside a collective (a loop "
                   "waiting on another rank?). Exiting so that the test fails instead of "
                   "hanging.\n",
                   stuck.c_str(), static_cast<long long>(elapsed),
                   first_done ? " and long after another rank returned" : "",
                   static_cast<long long>(timeout.count()));
      std::fflush(stderr);
      std::_Exit(124);
    }
  }
  for (auto& t : threads) t.join();

  std::string report;
  for (int r = 0; r < world; ++r) {
    if (!errors[r].empty()) {
      report += fmt::format("rank {} of {} failed: {}\n", r, world, errors[r]);
    }
  }
  if (!report.empty()) throw std::runtime_error(report);
}

}  // namespace dtc
