// Process groups, subgroups, the store rules and the thread-rank harness. Expected values are
// closed forms: ranks 0..n-1 summed are n(n-1)/2.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "dtc/compare.h"
#include "dtc/dist.h"
#include "dtc/errors.h"
#include "dtc/ranks.h"
#include "dtc_test.h"

namespace dtc {
namespace {

using std::chrono::milliseconds;

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

class RunRanksTest : public testing::TestWithParam<int> {};

TEST_P(RunRanksTest, AllreduceSumOfRanks) {
  const int world = GetParam();
  run_ranks(world, [&](RankContext& ctx) {
    std::vector<at::Tensor> t{torch::full({5}, static_cast<float>(ctx.rank))};
    ctx.comm->allreduce(t)->wait();
    EXPECT_TENSOR_CLOSE(t[0], torch::full({5}, world * (world - 1) / 2.0f), kExact);
  });
}

TEST_P(RunRanksTest, BroadcastAndAllgather) {
  const int world = GetParam();
  run_ranks(world, [&](RankContext& ctx) {
    std::vector<at::Tensor> b{torch::full({3}, ctx.rank == 0 ? 42.0f : -1.0f)};
    ctx.comm->broadcast(b)->wait();
    EXPECT_TENSOR_CLOSE(b[0], torch::full({3}, 42.0f), kExact);
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < world; ++r) out[0].push_back(torch::empty({2}));
    std::vector<at::Tensor> in{torch::full({2}, static_cast<float>(ctx.rank))};
    ctx.comm->allgather(out, in)->wait();
    for (int r = 0; r < world; ++r) {
      EXPECT_TENSOR_CLOSE(out[0][r], torch::full({2}, static_cast<float>(r)), kExact);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, RunRanksTest, testing::Values(1, 2, 3, 4));

TEST(RunRanks, AHangBecomesAnErrorNamingTheRank) {
  // Rank 1 skips the collective: rank 0 must fail within the timeout, not hang.
  const auto start = std::chrono::steady_clock::now();
  try {
    run_ranks(
        2,
        [](RankContext& ctx) {
          if (ctx.rank == 1) return;
          std::vector<at::Tensor> t{torch::ones({4})};
          ctx.comm->allreduce(t)->wait();
        },
        milliseconds(1000));
    FAIL() << "expected a timeout error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 of 2 failed"), std::string::npos) << e.what();
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(secs, 8.0) << "the 1 s timeout took " << secs << " s to fire";
}

TEST(RunRanks, ARankStuckOutsideACollectiveEndsTheProcess) {
  // Rank 0 returns; rank 1 waits forever on something that is no collective. The watchdog must
  // end the process (exit 124, naming rank 1) about 2 x timeout + 5 x timeout after rank 0
  // returned, instead of hanging the test binary.
  if (ranks_forced_to_gloo()) {
    // A death test forks, and the child inherits none of the threads of gloo's transport device
    // (one per process, started by earlier tests), which its new communicators would need.
    GTEST_SKIP() << "a fork under DTC_RANKS_TRANSPORT=gloo";
  }
  EXPECT_EXIT(run_ranks(
                  2,
                  [](RankContext& ctx) {
                    if (ctx.rank == 0) return;
                    for (;;) std::this_thread::sleep_for(milliseconds(50));
                  },
                  milliseconds(200)),
              testing::ExitedWithCode(124), "rank\\(s\\) 1 still running");
}

TEST(RunRanks, ExceptionsAreReportedPerRank) {
  try {
    run_ranks(3, [](RankContext& ctx) {
      if (ctx.rank == 2) throw std::runtime_error("boom");
    });
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2 of 3 failed: boom"), std::string::npos)
        << e.what();
  }
}

TEST(RunRanks, LibTorchErrorsComeWithoutTheirBacktrace) {
  try {
    run_ranks(2, [](RankContext& ctx) {
      if (ctx.rank == 1) torch::ones({2}).view({3});  // a shape error, thrown by LibTorch
    });
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 1 of 2 failed: "), std::string::npos) << what;
    EXPECT_NE(what.find("shape '[3]' is invalid"), std::string::npos) << what;
    EXPECT_EQ(what.find("Exception raised from"), std::string::npos)
        << "LibTorch's backtrace reached the message: " << what;
  }
}

TEST(Subgroups, EvenAndOddRanks) {
  // new_group([0, 2]) and new_group([1, 3]) over 4 ranks: each sums its own members.
  run_ranks(4, [](RankContext& ctx) {
    const std::vector<int> even{0, 2}, odd{3, 1};  // any order: sorted inside
    auto g_even =
        new_subgroup(ctx.store, "even", even, ctx.rank, BackendKind::kGloo, milliseconds(5000));
    auto g_odd =
        new_subgroup(ctx.store, "odd", odd, ctx.rank, BackendKind::kGloo, milliseconds(5000));
    auto mine = ctx.rank % 2 == 0 ? g_even : g_odd;
    ASSERT_TRUE(mine);
    EXPECT_FALSE(ctx.rank % 2 == 0 ? g_odd : g_even) << "not a member: nullptr";
    EXPECT_EQ(mine->getSize(), 2);
    EXPECT_EQ(mine->getRank(), ctx.rank / 2) << "index in the sorted member list";
    std::vector<at::Tensor> t{torch::full({2}, static_cast<float>(ctx.rank))};
    mine->allreduce(t)->wait();
    const float expected = ctx.rank % 2 == 0 ? 0 + 2 : 1 + 3;
    EXPECT_TENSOR_CLOSE(t[0], torch::full({2}, expected), kExact);
  });
}

LaunchEnv torchrun_env(int rank, int world, int port, bool agent) {
  LaunchEnv env;
  env.launcher = Launcher::kTorchrun;
  env.rank = env.local_rank = rank;
  env.world_size = env.local_world_size = world;
  env.master_port = port;
  env.use_agent_store = agent;
  return env;
}

void two_ranks_over_tcp(int port, bool agent) {
  std::vector<std::thread> ranks;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        Distributed d = init_distributed(torchrun_env(r, 2, port, agent),
                                         {BackendKind::kGloo, milliseconds(10000)});
        std::vector<at::Tensor> t{torch::full({3}, static_cast<float>(r + 1))};
        d.comm->allreduce(t)->wait();
        if (!t[0].eq(3).all().item<bool>()) errors[r] = "allreduce gave the wrong sum";
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(Store, RankZeroHostsTheTcpStore) { two_ranks_over_tcp(free_port(), /*agent=*/false); }

TEST(Store, AgentHostsTheStoreAndEveryRankConnects) {
  // torchrun's agent has the store already: rank 0 must not try to host a second one.
  auto agent = new_tcp_store("127.0.0.1", 0, /*is_server=*/true, 2, milliseconds(10000));
  two_ranks_over_tcp(tcp_store_port(agent), /*agent=*/true);
}

TEST(Store, KeysAreScopedByRestart) {
  auto server = new_tcp_store("127.0.0.1", 0, true, 1, milliseconds(5000));
  LaunchEnv first = torchrun_env(0, 1, tcp_store_port(server), /*agent=*/true);
  LaunchEnv second = first;
  second.restart_count = 1;
  auto s0 = connect_store(first, milliseconds(5000));
  auto s1 = connect_store(second, milliseconds(5000));
  s0->set("ready", std::vector<uint8_t>{1});
  EXPECT_TRUE(s0->check({"ready"}));
  EXPECT_FALSE(s1->check({"ready"})) << "a restarted attempt must not see the old keys";
}

TEST(Store, PortInUseSaysSo) {
  auto taken = new_tcp_store("127.0.0.1", 0, true, 1, milliseconds(2000));
  LaunchEnv env = torchrun_env(0, 1, tcp_store_port(taken), /*agent=*/false);
  try {
    connect_store(env, milliseconds(2000));
    FAIL() << "hosting a second store on a used port should fail";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_PORT"), std::string::npos) << e.what();
  }
}

TEST(Backend, ParseBackend) {
  EXPECT_EQ(parse_backend("gloo"), BackendKind::kGloo);
  if (kHaveNccl) {
    EXPECT_EQ(parse_backend("nccl"), BackendKind::kNccl);  // a CUDA LibTorch
  } else {
    try {
      parse_backend("nccl");
      FAIL() << "expected UsageError: this LibTorch has no NCCL";
    } catch (const UsageError& e) {
      EXPECT_EQ(e.subject(), "--backend");
    }
  }
  EXPECT_THROW(parse_backend("mpi2"), UsageError);
}

}  // namespace
}  // namespace dtc
