// The thread-ranks' communicator (dtc/local_comm.h) against gloo: every operation the course
// uses, on 2, 3 and 4 ranks, run over both transports, each result compared with its closed form
// computed here from the ranks' inputs; then what it must do as gloo does (a send completes only
// once its receive is posted, a barrier waits for the rank's earlier calls) and what it says when
// the ranks disagree or one never calls.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>

#include "dtc/compare.h"
#include "dtc/dist.h"
#include "dtc/local_comm.h"
#include "dtc/memory.h"
#include "dtc/ranks.h"
#include "dtc_test.h"

namespace dtc {
namespace {

using std::chrono::milliseconds;
using test::kTimeout;

/// gloo in LibTorch 1.13 (the light path) has no bf16 collectives, no _allgather_base and no
/// reduce_scatter; the local communicator refuses them there too.
constexpr bool kGloo113 = TORCH_VERSION_MAJOR < 2;

/// Rank r's input: distinct values per rank and element, exact in bf16.
at::Tensor input_of(int rank, int64_t n, at::ScalarType dtype = at::kFloat) {
  return (torch::arange(n, torch::kFloat) * 0.25 + rank * 8 + 1).to(dtype);
}

struct Case {
  RanksTransport transport;
  int world;
};

std::string name_of(const testing::TestParamInfo<Case>& info) {
  return std::string(info.param.transport == RanksTransport::kLocal ? "local" : "gloo") +
         std::to_string(info.param.world);
}

std::vector<Case> cases() {
  std::vector<Case> all;
  for (auto t : {RanksTransport::kLocal, RanksTransport::kGloo}) {
    for (int w : test::kWorlds) all.push_back({t, w});
  }
  return all;
}

class LocalVsGloo : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (ranks_forced_to_gloo() && GetParam().transport == RanksTransport::kLocal) {
      GTEST_SKIP() << "gloo forced";
    }
  }
  void run(const std::function<void(RankContext&)>& body) {
    run_ranks(GetParam().world, body, kTimeout, GetParam().transport);
  }
};

TEST_P(LocalVsGloo, TheTransportIsTheOneAskedFor) {
  const bool local = GetParam().transport == RanksTransport::kLocal;
  run([&](RankContext& ctx) {
    EXPECT_EQ(ctx.comm->getBackendName(), local ? "local" : "gloo");
    auto sub = new_subgroup(
        ctx.store, "all",
        [&] {
          std::vector<int> r(static_cast<size_t>(ctx.world));
          std::iota(r.begin(), r.end(), 0);
          return r;
        }(),
        ctx.rank, BackendKind::kGloo, kTimeout);
    EXPECT_EQ(sub->getBackendName(), local ? "local" : "gloo");
    sub->barrier()->wait();  // no rank tears the group down while another still connects
  });
}

TEST_P(LocalVsGloo, AllreduceSumMaxAndBf16AreTheClosedForms) {
  const int n = GetParam().world;
  at::Tensor sum = torch::zeros({7});
  for (int r = 0; r < n; ++r) sum += input_of(r, 7);
  run([&](RankContext& ctx) {
    std::vector<at::Tensor> t{input_of(ctx.rank, 7)};
    ctx.comm->allreduce(t)->wait();
    EXPECT_TENSOR_CLOSE(t[0], sum, kExact);  // small integers and quarters: exact in any order
    std::vector<at::Tensor> m{input_of(ctx.rank, 7)};
    ctx.comm->allreduce(m, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
    EXPECT_TENSOR_CLOSE(m[0], input_of(n - 1, 7), kExact);
    std::vector<at::Tensor> b{input_of(ctx.rank, 7, at::kBFloat16)};
    if (kGloo113) {
      EXPECT_ANY_THROW(ctx.comm->allreduce(b)->wait());
      return;
    }
    ctx.comm->allreduce(b)->wait();
    EXPECT_EQ(b[0].scalar_type(), at::kBFloat16);
    EXPECT_TENSOR_CLOSE(b[0].to(at::kFloat), sum, kBf16Op);
  });
}

TEST_P(LocalVsGloo, BroadcastAndReduceReachTheirRoot) {
  const int n = GetParam().world;
  const int root = n - 1;
  at::Tensor sum = torch::zeros({4, 3});
  for (int r = 0; r < n; ++r) sum += input_of(r, 12).view({4, 3});
  run([&](RankContext& ctx) {
    std::vector<at::Tensor> t{input_of(ctx.rank, 12).view({4, 3})};
    c10d::BroadcastOptions bo;
    bo.rootRank = root;
    ctx.comm->broadcast(t, bo)->wait();
    EXPECT_TENSOR_CLOSE(t[0], input_of(root, 12).view({4, 3}), kExact);
    std::vector<at::Tensor> r{input_of(ctx.rank, 12).view({4, 3})};
    c10d::ReduceOptions ro;
    ro.rootRank = root;
    ctx.comm->reduce(r, ro)->wait();
    if (ctx.rank == root) EXPECT_TENSOR_CLOSE(r[0], sum, kExact);
  });
}

TEST_P(LocalVsGloo, AllgatherListAndIntoOneTensorInPlace) {
  const int n = GetParam().world;
  run([&](RankContext& ctx) {
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < n; ++r) out[0].push_back(torch::full({5}, -1.0f));
    std::vector<at::Tensor> in{input_of(ctx.rank, 5)};
    ctx.comm->allgather(out, in)->wait();
    for (int r = 0; r < n; ++r) EXPECT_TENSOR_CLOSE(out[0][r], input_of(r, 5), kExact);
    // FSDP's way: the input is this rank's slice of the output
    at::Tensor flat = torch::full({n * 5}, -1.0f);
    at::Tensor mine = flat.narrow(0, ctx.rank * 5, 5);
    mine.copy_(input_of(ctx.rank, 5));
    if (kGloo113) {
      EXPECT_ANY_THROW(ctx.comm->_allgather_base(flat, mine)->wait());
      return;
    }
    ctx.comm->_allgather_base(flat, mine)->wait();
    for (int r = 0; r < n; ++r)
      EXPECT_TENSOR_CLOSE(flat.narrow(0, r * 5, 5), input_of(r, 5), kExact);
  });
}

TEST_P(LocalVsGloo, ReduceScatterGivesEachRankItsChunksSum) {
  const int n = GetParam().world;
  at::Tensor sum = torch::zeros({n * 3});
  for (int r = 0; r < n; ++r) sum += input_of(r, n * 3);
  run([&](RankContext& ctx) {
    at::Tensor out = torch::full({3}, -1.0f);
    at::Tensor in = input_of(ctx.rank, n * 3);
    if (kGloo113) {
      EXPECT_ANY_THROW(ctx.comm->_reduce_scatter_base(out, in)->wait());
      return;
    }
    ctx.comm->_reduce_scatter_base(out, in)->wait();
    EXPECT_TENSOR_CLOSE(out, sum.narrow(0, ctx.rank * 3, 3), kExact);
    std::vector<at::Tensor> outs{torch::full({3}, -1.0f)};
    std::vector<std::vector<at::Tensor>> ins{in.chunk(n)};
    ctx.comm->reduce_scatter(outs, ins)->wait();
    EXPECT_TENSOR_CLOSE(outs[0], sum.narrow(0, ctx.rank * 3, 3), kExact);
  });
}

TEST_P(LocalVsGloo, AlltoallWithUnevenAndEmptySplits) {
  const int n = GetParam().world;
  // rank r sends (r + j) % 3 rows to rank j (some of them none), each row [r, j, k]
  auto rows = [](int r, int j) { return static_cast<int64_t>((r + j) % 3); };
  run([&](RankContext& ctx) {
    const int r = ctx.rank;
    std::vector<int64_t> in_splits, out_splits;
    std::vector<at::Tensor> in_rows, want_rows;
    for (int j = 0; j < n; ++j) {
      in_splits.push_back(rows(r, j));
      out_splits.push_back(rows(j, r));
      for (int64_t k = 0; k < rows(r, j); ++k) {
        in_rows.push_back(torch::tensor({float(r), float(j), float(k)}).view({1, 3}));
      }
      for (int64_t k = 0; k < rows(j, r); ++k) {
        want_rows.push_back(torch::tensor({float(j), float(r), float(k)}).view({1, 3}));
      }
    }
    auto cat = [](const std::vector<at::Tensor>& t) {
      return t.empty() ? torch::zeros({0, 3}) : torch::cat(t);
    };
    at::Tensor in = cat(in_rows);
    at::Tensor out = torch::full({cat(want_rows).size(0), 3}, -1.0f);
    ctx.comm->alltoall_base(out, in, out_splits, in_splits)->wait();
    EXPECT_TENSOR_CLOSE(out, cat(want_rows), kExact);
  });
}

TEST_P(LocalVsGloo, SendAndRecvAroundTheRingByTag) {
  const int n = GetParam().world;
  run([&](RankContext& ctx) {
    const int next = (ctx.rank + 1) % n, prev = (ctx.rank + n - 1) % n;
    // two messages to the same peer, told apart by their tags, received in the other order
    std::vector<at::Tensor> a{input_of(ctx.rank, 4)}, b{input_of(ctx.rank, 4) * 2};
    auto s1 = ctx.comm->send(a, next, 1);
    auto s2 = ctx.comm->send(b, next, 2);
    std::vector<at::Tensor> got2{torch::empty({4})}, got1{torch::empty({4})};
    ctx.comm->recv(got2, prev, 2)->wait();
    ctx.comm->recv(got1, prev, 1)->wait();
    s1->wait();
    s2->wait();
    EXPECT_TENSOR_CLOSE(got1[0], input_of(prev, 4), kExact);
    EXPECT_TENSOR_CLOSE(got2[0], input_of(prev, 4) * 2, kExact);
    ctx.comm->barrier()->wait();
  });
}

TEST_P(LocalVsGloo, AvgIsTheMeanWhereGlooHasItAndRefusedWhereNot) {
  const int n = GetParam().world;
  const bool has_avg = TORCH_VERSION_MAJOR >= 2;  // gloo's AVG: LibTorch 2 (1.13 refuses it)
  at::Tensor sum = torch::zeros({6});
  for (int r = 0; r < n; ++r) sum += input_of(r, 6);
  run([&](RankContext& ctx) {
    std::vector<at::Tensor> t{input_of(ctx.rank, 6)};
    const c10d::AllreduceOptions avg{c10d::ReduceOp::AVG};
    if (!has_avg) {
      EXPECT_ANY_THROW(ctx.comm->allreduce(t, avg)->wait());
      return;
    }
    ctx.comm->allreduce(t, avg)->wait();
    EXPECT_TENSOR_CLOSE(t[0], sum / n, kFp32Op);
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, LocalVsGloo, testing::ValuesIn(cases()), name_of);

// What only the local communicator is asked here: gloo's behaviour, where a test can see it.
// (Skipped when DTC_RANKS_TRANSPORT=gloo runs every thread-rank test over gloo.)

class LocalComm : public testing::Test {
 protected:
  void SetUp() override {
    if (ranks_forced_to_gloo()) GTEST_SKIP() << "gloo forced";
  }
};

TEST_F(LocalComm, ASendCompletesOnlyOnceItsReceiveIsPosted) {
  run_ranks(2, [](RankContext& ctx) {
    std::vector<at::Tensor> t{torch::ones({3})};
    if (ctx.rank == 0) {
      auto w = ctx.comm->send(t, 1, 0);
      std::this_thread::sleep_for(milliseconds(100));
      EXPECT_FALSE(w->isCompleted()) << "a send completed with no receive posted";
      ctx.store->set("posting", std::vector<uint8_t>{1});
      w->wait();
      EXPECT_TRUE(w->isCompleted());
    } else {
      ctx.store->get("posting");  // rank 0 has checked its send
      ctx.comm->recv(t, 0, 0)->wait();
    }
  });
}

TEST_F(LocalComm, MovesTheDataWithoutAllocating) {
  install_counting_allocator();
  run_ranks(3, [](RankContext& ctx) {
    std::vector<at::Tensor> t{input_of(ctx.rank, 64)};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < 3; ++r) out[0].push_back(torch::empty({64}));
    std::vector<at::Tensor> got{torch::empty({64})};
    ctx.comm->barrier()->wait();
    mark_thread_cpu_memory();
    ctx.comm->allreduce(t)->wait();
    ctx.comm->allgather(out, t)->wait();
    auto s = ctx.comm->send(t, (ctx.rank + 1) % 3, 0);
    ctx.comm->recv(got, (ctx.rank + 2) % 3, 0)->wait();
    s->wait();
    // Whichever rank completed an operation moved the data of all: none allocated for it.
    EXPECT_EQ(thread_cpu_memory_since_mark(), 0) << "this rank's thread allocated";
    ctx.comm->barrier()->wait();
  });
}

TEST_F(LocalComm, ARankThatNeverCallsIsNamedWhenTheOthersTimeOut) {
  try {
    run_ranks(
        3,
        [](RankContext& ctx) {
          if (ctx.rank == 2) return;
          std::vector<at::Tensor> t{torch::ones({2})};
          ctx.comm->allreduce(t)->wait();
        },
        milliseconds(300));
    FAIL() << "the allreduce completed without rank 2";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("Timed out waiting 300ms for allreduce"), std::string::npos) << what;
    EXPECT_NE(what.find("rank(s) 2 of the group never issued it"), std::string::npos) << what;
  }
}

TEST_F(LocalComm, MismatchedCallsFailOnEveryRankWithWhatEachCalled) {
  try {
    run_ranks(2, [](RankContext& ctx) {
      std::vector<at::Tensor> t{torch::ones({2})};
      if (ctx.rank == 0) {
        ctx.comm->allreduce(t)->wait();
      } else {
        ctx.comm->broadcast(t)->wait();
      }
    });
    FAIL() << "an allreduce matched a broadcast";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 0 of 2 failed"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 1 of 2 failed"), std::string::npos) << what;
    EXPECT_NE(what.find("does not match"), std::string::npos) << what;
  }
  try {
    run_ranks(2, [](RankContext& ctx) {
      std::vector<at::Tensor> t{torch::ones({2 + ctx.rank})};
      ctx.comm->allreduce(t)->wait();
    });
    FAIL() << "tensors of 2 and 3 elements were reduced together";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 passed Float[3], rank 0 Float[2]"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace dtc
