#include "dtc/ranks.h"

#include <fmt/format.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "dtc/dist.h"

namespace dtc {

void run_ranks(int world, const std::function<void(RankContext&)>& body,
               std::chrono::milliseconds timeout) {
  if (world < 1) throw std::invalid_argument(fmt::format("run_ranks: world {} < 1", world));
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
        RankContext ctx;
        ctx.rank = r;
        ctx.world = world;
        ctx.store = store;
        ctx.comm = new_comm(store, r, world, BackendKind::kGloo, timeout);
        body(ctx);
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
    std::unique_lock<std::mutex> lock(mu);
    const auto deadline = std::chrono::steady_clock::now() + 2 * timeout + std::chrono::seconds(5);
    if (!done_cv.wait_until(lock, deadline, [&] { return done == world; })) {
      std::string stuck;
      for (int r = 0; r < world; ++r) {
        if (!finished[r]) stuck += fmt::format(" {}", r);
      }
      std::fprintf(stderr,
                   "FATAL: run_ranks: rank(s)%s still running %lld ms after the start, past the "
                   "%lld ms collective timeout. A rank is stuck outside a collective (a loop "
                   "waiting on another rank?). Exiting so that the test fails instead of "
                   "hanging.\n",
                   stuck.c_str(),
                   static_cast<long long>((2 * timeout + std::chrono::seconds(5)).count()),
                   static_cast<long long>(timeout.count()));
      std::fflush(stderr);
      std::_Exit(124);
    }
  }
  for (auto& t : threads) t.join();

  std::string report;
  for (int r = 0; r < world; ++r) {
    if (!errors[r].empty()) report += fmt::format("rank {} failed: {}\n", r, errors[r]);
  }
  if (!report.empty()) throw std::runtime_error(report);
}

}  // namespace dtc
