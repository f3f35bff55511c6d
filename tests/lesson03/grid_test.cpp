// Lesson 03 tests, part 2: the DP x TP x PP rank grid (Megatron-LM order: tp fastest, then dp,
// then pp) and its subgroups. References: Megatron-LM's own 16-GPU example
// (megatron/core/parallel_state.py, initialize_model_parallel's docstring), a hand-written
// table for 8 ranks, and sums of group members in closed form.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <set>

#include "collectives.h"
#include "dtc/errors.h"
#include "dtc/ranks.h"
#include "dtc_test.h"

namespace dtc::l03 {
namespace {

using Groups = std::vector<std::vector<int>>;

// Megatron-LM, initialize_model_parallel: "16 GPUs ... 2 GPUs to parallelize the model tensor,
// and 4 GPUs to parallelize the model pipeline".
TEST(L03Grid, MegatronSixteenGpuExample) {
  const RankGrid grid = make_grid(16, 2, 2, 4);
  EXPECT_EQ(all_groups(grid, Axis::kDp),
            (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}}));
  EXPECT_EQ(all_groups(grid, Axis::kTp),
            (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}}));
  EXPECT_EQ(all_groups(grid, Axis::kPp),
            (Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}));
}

// dp 2 x tp 2 x pp 2 by hand: rank -> (dp, tp, pp)
const std::map<int, GridCoord> kEightRanks = {{0, {0, 0, 0}}, {1, {0, 1, 0}}, {2, {1, 0, 0}},
                                              {3, {1, 1, 0}}, {4, {0, 0, 1}}, {5, {0, 1, 1}},
                                              {6, {1, 0, 1}}, {7, {1, 1, 1}}};

TEST(L03Grid, CoordinatesByHand) {
  const RankGrid grid = make_grid(8, 2, 2, 2);
  for (const auto& [rank, coord] : kEightRanks) {
    SCOPED_TRACE(testing::Message() << "rank " << rank);
    const GridCoord got = grid_coords(grid, rank);
    EXPECT_EQ(got.dp, coord.dp);
    EXPECT_EQ(got.tp, coord.tp);
    EXPECT_EQ(got.pp, coord.pp);
    EXPECT_EQ(grid_rank(grid, coord), rank);
  }
  EXPECT_EQ(group_ranks(grid, 5, Axis::kTp), (std::vector<int>{4, 5}));
  EXPECT_EQ(group_ranks(grid, 5, Axis::kDp), (std::vector<int>{5, 7}));
  EXPECT_EQ(group_ranks(grid, 5, Axis::kPp), (std::vector<int>{1, 5}));
}

TEST(L03Grid, ClosedFormOnManyLayouts) {
  // rank = tp + TP (dp + DP pp), for every rank of several layouts (12 ranks: 2 x 3 x 2, ...)
  for (auto [dp, tp, pp] :
       {std::tuple{4, 1, 1}, {1, 4, 1}, {1, 1, 4}, {2, 3, 2}, {3, 2, 2}, {2, 2, 3}, {1, 1, 1}}) {
    const RankGrid grid = make_grid(dp * tp * pp, dp, tp, pp);
    SCOPED_TRACE(testing::Message() << "dp " << dp << " tp " << tp << " pp " << pp);
    for (int p = 0; p < pp; ++p) {
      for (int d = 0; d < dp; ++d) {
        for (int t = 0; t < tp; ++t) {
          const int rank = t + tp * (d + dp * p);
          EXPECT_EQ(grid_rank(grid, GridCoord{d, t, p}), rank);
          const GridCoord c = grid_coords(grid, rank);
          EXPECT_TRUE((c == GridCoord{d, t, p})) << "rank " << rank;
          // tp group: consecutive; dp group: stride tp; pp group: stride tp * dp
          std::vector<int> tp_group, dp_group, pp_group;
          for (int i = 0; i < tp; ++i) tp_group.push_back(i + tp * (d + dp * p));
          for (int i = 0; i < dp; ++i) dp_group.push_back(t + tp * (i + dp * p));
          for (int i = 0; i < pp; ++i) pp_group.push_back(t + tp * (d + dp * i));
          EXPECT_EQ(group_ranks(grid, rank, Axis::kTp), tp_group) << "rank " << rank;
          EXPECT_EQ(group_ranks(grid, rank, Axis::kDp), dp_group) << "rank " << rank;
          EXPECT_EQ(group_ranks(grid, rank, Axis::kPp), pp_group) << "rank " << rank;
        }
      }
    }
    // Each axis's groups partition the ranks: world / degree groups of degree ranks.
    for (auto [axis, degree] : {std::pair{Axis::kDp, dp}, {Axis::kTp, tp}, {Axis::kPp, pp}}) {
      const Groups groups = all_groups(grid, axis);
      EXPECT_EQ(static_cast<int>(groups.size()), grid.world / degree) << axis_name(axis);
      std::set<int> seen;
      for (const auto& g : groups) {
        EXPECT_EQ(static_cast<int>(g.size()), degree) << axis_name(axis);
        seen.insert(g.begin(), g.end());
      }
      EXPECT_EQ(static_cast<int>(seen.size()), grid.world) << axis_name(axis);
    }
  }
}

TEST(L03Grid, OutsideTheGridThrows) {
  const RankGrid grid = make_grid(4, 2, 2, 1);
  EXPECT_THROW(grid_coords(grid, 4), std::out_of_range);
  EXPECT_THROW(grid_rank(grid, GridCoord{2, 0, 0}), std::out_of_range);
  // and a rank inside it works (so the test fails on a TODO, not on the throws above)
  EXPECT_EQ(grid_rank(grid, grid_coords(grid, 3)), 3);
}

// The subgroups, built by 8 thread-ranks (dp 2 x tp 2 x pp 2). Each member allreduces its global
// rank in each of its groups; the hand table above gives the members, so the sums are closed
// forms: tp group of r is {2k, 2k+1} (k = r / 2), dp group {b, b+2} with b = r - 2 dp(r),
// pp group {r % 4, r % 4 + 4}.
TEST(L03GridGroups, EightRanksAllreduceInEachGroup) {
  const RankGrid grid = make_grid(8, 2, 2, 2);
  run_ranks(
      8,
      [&](RankContext& ctx) {
        const int r = ctx.rank;
        const GridCoord me = kEightRanks.at(r);
        GridGroups g = build_grid_groups(ctx.store, grid, r, std::chrono::milliseconds(3000));
        EXPECT_TRUE((g.coord == me));
        const int k = r / 2, b = r - 2 * me.dp, q = r % 4;
        const std::vector<std::tuple<const char*, c10::intrusive_ptr<Comm>, int, float>> cases = {
            {"tp", g.tp, me.tp, 4.0f * k + 1},
            {"dp", g.dp, me.dp, 2.0f * b + 2},
            {"pp", g.pp, me.pp, 2.0f * q + 4}};
        for (const auto& [name, comm, coord, sum] : cases) {
          ASSERT_TRUE(comm) << name << " group missing on rank " << r;
          EXPECT_EQ(comm->getSize(), 2) << name;
          EXPECT_EQ(comm->getRank(), coord) << name << " rank in the group = coordinate";
          std::vector<at::Tensor> t{torch::full({1}, static_cast<float>(r))};
          comm->allreduce(t)->wait();
          EXPECT_EQ(t[0].item<float>(), sum) << name << " group of rank " << r;
        }
      },
      std::chrono::milliseconds(3000));
}

// make_grid and axis_name are given: they pass on the untouched exercise.
TEST(L03GridGiven, MakeGridChecksTheDegrees) {
  EXPECT_NO_THROW(make_grid(8, 2, 2, 2));
  try {
    make_grid(4, 1, 3, 1);
    ADD_FAILURE() << "dp 1 x tp 3 x pp 1 != 4 must throw";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("HINT"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("1, 2, 4"), std::string::npos)
        << "the hint lists the divisors of 4: " << e.what();
  }
  EXPECT_THROW(make_grid(4, 0, 2, 2), UsageError);
  EXPECT_THROW(make_grid(4, 2, 2, -1), UsageError);
  EXPECT_STREQ(axis_name(Axis::kDp), "dp");
  EXPECT_STREQ(axis_name(Axis::kTp), "tp");
  EXPECT_STREQ(axis_name(Axis::kPp), "pp");
}

}  // namespace
}  // namespace dtc::l03
