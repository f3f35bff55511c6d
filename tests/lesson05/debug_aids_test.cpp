// Lesson 05 tests: the "who is missing" barrier and collective fingerprinting (debug_aids.h).
// Ranks are threads over one HashStore; some ranks stay away on purpose. Every expectation is the
// header's rule applied by hand (which ranks were left out, which calls were made); every wait
// has a deadline, and each test checks that the diagnosis came within it.
//   build/tests/lesson05_tests --gtest_filter='L05*'
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "debug_aids.h"
#include "dtc/ranks.h"
#include "dtc/todo.h"

namespace dtc::l05 {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// What one thread-rank's call ended with: "ok", "missing:<ranks>|<message>",
// "mismatch|<message>", "invalid|<message>", or "other|<message>" (a TODO stub's included, so
// that its TODO(L05) text shows in the failure).
struct Outcome {
  std::string kind;
  std::string message;
  std::vector<int> missing;
  double seconds = 0;
};

// Runs body(rank, store) on the ranks in @p present (threads) over one fresh HashStore; the
// other ranks of the world never run.
std::vector<Outcome> run_present(const std::vector<int>& present,
                                 const std::function<void(int, c10d::Store&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<Outcome> out(present.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < present.size(); ++i) {
    threads.emplace_back([&, i] {
      const auto t0 = Clock::now();
      try {
        body(present[i], *store);
        out[i].kind = "ok";
      } catch (const MissingRanksError& e) {
        out[i] = {"missing", e.what(), e.missing()};
      } catch (const CollectiveMismatchError& e) {
        out[i] = {"mismatch", e.what(), {}};
      } catch (const std::invalid_argument& e) {
        out[i] = {"invalid", e.what(), {}};
      } catch (const std::exception& e) {
        out[i] = {"other", e.what(), {}};
      }
      out[i].seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

std::string show(const Outcome& o) { return o.kind + ": " + o.message; }

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// --- the barrier ----------------------------------------------------------------------------

TEST(L05Barrier, AllRanksArrive) {
  for (int world : {1, 2, 4}) {
    std::vector<int> all;
    for (int r = 0; r < world; ++r) all.push_back(r);
    auto got = run_present(all, [&](int rank, c10d::Store& store) {
      barrier_with_report(store, "start", rank, world, milliseconds(2000));
    });
    for (const auto& o : got) EXPECT_EQ(o.kind, "ok") << "world " << world << ": " << show(o);
  }
}

TEST(L05Barrier, LateRankStillCounts) {
  // Rank 2 arrives 200 ms late, well inside the 3 s timeout.
  auto got = run_present({0, 1, 2}, [&](int rank, c10d::Store& store) {
    if (rank == 2) std::this_thread::sleep_for(milliseconds(200));
    barrier_with_report(store, "late", rank, 3, milliseconds(3000));
  });
  for (const auto& o : got) EXPECT_EQ(o.kind, "ok") << show(o);
}

TEST(L05Barrier, NamesTheRanksThatNeverArrive) {
  // World 4, only ranks 0 and 1 start: both must say "2, 3", after the timeout, not much later.
  const auto timeout = milliseconds(300);
  auto got = run_present({0, 1}, [&](int rank, c10d::Store& store) {
    barrier_with_report(store, "start", rank, 4, timeout);
  });
  for (size_t i = 0; i < got.size(); ++i) {
    const auto& o = got[i];
    ASSERT_EQ(o.kind, "missing") << show(o);
    EXPECT_EQ(o.missing, (std::vector<int>{2, 3}));
    EXPECT_TRUE(
        contains(o.message, "barrier 'start': rank(s) 2, 3 of 4 never arrived within 300 ms"))
        << o.message;
    EXPECT_TRUE(contains(o.message, "(seen from rank " + std::to_string(i) + ")")) << o.message;
    EXPECT_GE(o.seconds, 0.3);
    EXPECT_LT(o.seconds, 2.3) << "the diagnosis must come soon after the timeout";
  }
}

TEST(L05Barrier, WrongWorldSizeShowsAsAMissingRank) {
  // Two processes were started, but both believe WORLD_SIZE=3: rank 2 is missing.
  auto got = run_present({0, 1}, [&](int rank, c10d::Store& store) {
    barrier_with_report(store, "start", rank, 3, milliseconds(200));
  });
  for (const auto& o : got) {
    ASSERT_EQ(o.kind, "missing") << show(o);
    EXPECT_EQ(o.missing, (std::vector<int>{2}));
  }
}

TEST(L05Barrier, BarriersWithDifferentNamesAreIndependent) {
  // All pass barrier "a"; only rank 0 reaches barrier "b": rank 1 is missing from "b" only.
  auto got = run_present({0, 1}, [&](int rank, c10d::Store& store) {
    barrier_with_report(store, "a", rank, 2, milliseconds(2000));
    if (rank == 0) barrier_with_report(store, "b", rank, 2, milliseconds(200));
  });
  ASSERT_EQ(got[0].kind, "missing") << show(got[0]);
  EXPECT_EQ(got[0].missing, (std::vector<int>{1}));
  EXPECT_TRUE(contains(got[0].message, "barrier 'b'")) << got[0].message;
  EXPECT_EQ(got[1].kind, "ok") << show(got[1]);
}

TEST(L05Barrier, RejectsARankOutsideTheWorld) {
  auto got = run_present({5}, [&](int rank, c10d::Store& store) {
    barrier_with_report(store, "start", rank, 3, milliseconds(100));
  });
  EXPECT_EQ(got[0].kind, "invalid") << show(got[0]);
}

// --- fingerprints -----------------------------------------------------------------------------

Fingerprint fp(int64_t seq, const std::string& op, std::vector<std::vector<int64_t>> shapes,
               std::vector<std::string> dtypes) {
  Fingerprint f;
  f.seq = seq;
  f.op = op;
  f.shapes = std::move(shapes);
  f.dtypes = std::move(dtypes);
  return f;
}

TEST(L05Fingerprint, SameCallsPass) {
  auto got = run_present({0, 1, 2}, [&](int rank, c10d::Store& store) {
    check_fingerprint(store, rank, 3, fp(0, "allreduce", {{4, 8}}, {"Float"}), milliseconds(2000));
    check_fingerprint(store, rank, 3, fp(1, "broadcast(root=0)", {{2}}, {"Long"}),
                      milliseconds(2000));
  });
  for (const auto& o : got) EXPECT_EQ(o.kind, "ok") << show(o);
}

TEST(L05Fingerprint, ShapeMismatchNamesRanksAndCalls) {
  // Ranks 0 and 2 reduce 4 floats, rank 1 reduces 8: every rank fails, naming both groups.
  auto got = run_present({0, 1, 2}, [&](int rank, c10d::Store& store) {
    const int64_t n = rank == 1 ? 8 : 4;
    check_fingerprint(store, rank, 3, fp(0, "allreduce", {{n}}, {"Float"}), milliseconds(2000));
  });
  for (const auto& o : got) {
    ASSERT_EQ(o.kind, "mismatch") << show(o);
    EXPECT_TRUE(contains(o.message, "collective #0 differs across ranks")) << o.message;
    EXPECT_TRUE(contains(o.message, "rank(s) 0, 2: #0 allreduce(Float[4])")) << o.message;
    EXPECT_TRUE(contains(o.message, "rank(s) 1: #0 allreduce(Float[8])")) << o.message;
  }
}

TEST(L05Fingerprint, SkippedCollectiveShowsAsOpMismatch) {
  // Rank 1 skipped its allreduce: its collective #0 is the broadcast the others call next.
  auto got = run_present({0, 1}, [&](int rank, c10d::Store& store) {
    const auto mine = rank == 1 ? fp(0, "broadcast(root=0)", {{2}}, {"Float"})
                                : fp(0, "allreduce", {{4}}, {"Float"});
    check_fingerprint(store, rank, 2, mine, milliseconds(2000));
  });
  for (const auto& o : got) {
    ASSERT_EQ(o.kind, "mismatch") << show(o);
    EXPECT_TRUE(contains(o.message, "rank(s) 0: #0 allreduce(Float[4])")) << o.message;
    EXPECT_TRUE(contains(o.message, "rank(s) 1: #0 broadcast(root=0)(Float[2])")) << o.message;
  }
}

TEST(L05Fingerprint, DtypeMismatchIsCaught) {
  auto got = run_present({0, 1}, [&](int rank, c10d::Store& store) {
    check_fingerprint(store, rank, 2, fp(0, "allreduce", {{4}}, {rank == 0 ? "Float" : "Double"}),
                      milliseconds(2000));
  });
  for (const auto& o : got) {
    ASSERT_EQ(o.kind, "mismatch") << show(o);
    EXPECT_TRUE(contains(o.message, "rank(s) 1: #0 allreduce(Double[4])")) << o.message;
  }
}

TEST(L05Fingerprint, AbsentRankIsNamedWithTheAwaitedCall) {
  // Rank 1 of 2 never calls: rank 0 gives up after 300 ms and names rank 1 and the call.
  auto got = run_present({0}, [&](int rank, c10d::Store& store) {
    check_fingerprint(store, rank, 2, fp(0, "allreduce", {{4}}, {"Float"}), milliseconds(300));
  });
  ASSERT_EQ(got[0].kind, "missing") << show(got[0]);
  EXPECT_EQ(got[0].missing, (std::vector<int>{1}));
  EXPECT_TRUE(
      contains(got[0].message, "rank(s) 1 of 2 never reached collective #0 allreduce(Float[4])"))
      << got[0].message;
  EXPECT_GE(got[0].seconds, 0.3);
  EXPECT_LT(got[0].seconds, 2.3);
}

TEST(L05Fingerprint, MismatchAtALaterCallIsNamedByItsNumber) {
  auto got = run_present({0, 1}, [&](int rank, c10d::Store& store) {
    check_fingerprint(store, rank, 2, fp(0, "allreduce", {{4}}, {"Float"}), milliseconds(2000));
    check_fingerprint(store, rank, 2, fp(1, "allreduce", {{rank == 0 ? 3 : 5}}, {"Float"}),
                      milliseconds(2000));
  });
  for (const auto& o : got) {
    ASSERT_EQ(o.kind, "mismatch") << show(o);
    EXPECT_TRUE(contains(o.message, "collective #1 differs")) << o.message;
  }
}

// --- checked collectives on a real gloo communicator (thread ranks) ------------------------

TEST(L05Checked, MatchingCallsRunTheRealCollective) {
  // allreduce of ones on 3 ranks: 3 everywhere (closed form).
  run_ranks(
      3,
      [](RankContext& ctx) {
        CheckedComm comm(ctx.store, ctx.comm, milliseconds(3000));
        std::vector<at::Tensor> t{torch::ones({4})};
        comm.allreduce(t);
        EXPECT_TRUE(torch::equal(t[0], torch::full({4}, 3.0f))) << t[0];
        EXPECT_EQ(comm.calls(), 1);
      },
      milliseconds(3000));
}

TEST(L05Checked, SkippedCollectiveFailsFastWithADiagnosis) {
  // Without the check this is a deadlock or a wrong result; with it, a CollectiveMismatchError
  // on both ranks within the timeout.
  const auto t0 = Clock::now();
  std::vector<std::string> errors(2);
  run_ranks(
      2,
      [&](RankContext& ctx) {
        CheckedComm comm(ctx.store, ctx.comm, milliseconds(2000));
        std::vector<at::Tensor> a{torch::ones({4})};
        std::vector<at::Tensor> b{torch::ones({2})};
        try {
          if (ctx.rank != 1) comm.allreduce(a);
          comm.broadcast(b, 0);
          errors[ctx.rank] = "no error";
        } catch (const CollectiveMismatchError& e) {
          errors[ctx.rank] = std::string("mismatch: ") + e.what();
        } catch (const std::exception& e) {
          errors[ctx.rank] = std::string("other: ") + e.what();
        }
      },
      milliseconds(3000));
  for (const auto& e : errors) {
    EXPECT_TRUE(contains(e, "mismatch: collective #0 differs")) << e;
    EXPECT_TRUE(contains(e, "rank(s) 1: #0 broadcast(root=0)(Float[2])")) << e;
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 10.0);
}

}  // namespace
}  // namespace dtc::l05
