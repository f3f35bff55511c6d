// dtc::Mesh and dtc::MeshGroups. References from outside the code under test: the Llama 3
// paper's 16-GPU example (sec. 3.3.2) for which ranks share a group, and a LibTorch tensor
// arange(world).view(degrees) indexed as torchtitan's init_device_mesh lays out its mesh
// (row-major, the last dimension fastest) for every rank and every set of dimensions.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dtc/errors.h"
#include "dtc/mesh.h"
#include "dtc/ranks.h"

namespace dtc {
namespace {

std::string subject_of(int world, const std::vector<MeshDim>& dims) {
  try {
    Mesh::build(world, dims);
  } catch (const UsageError& e) {
    return e.subject() + " | " + e.what();
  }
  return "no error";
}

// Llama 3 (sec. 3.3.2): 16 GPUs, |TP| = |CP| = |PP| = |DP| = 2 in the order [TP, CP, PP, DP];
// GPU0 shares its TP group with GPU1, CP with GPU2, PP with GPU4, DP with GPU8. The course's
// order puts PP outside DP (torchtitan's), so the last two swap: DP with GPU4, PP with GPU8.
TEST(Mesh, GroupsOfTheLlama3ExampleInTorchtitansOrder) {
  const Mesh m = Mesh::build(
      16, {{"tp", 2, "--tp"}, {"cp", 2, "--cp"}, {"dp_shard", 2, "--dp"}, {"pp", 2, "--pp"}});
  EXPECT_EQ(m.group(0, {"tp"}), (std::vector<int>{0, 1}));
  EXPECT_EQ(m.group(0, {"cp"}), (std::vector<int>{0, 2}));
  EXPECT_EQ(m.group(0, {"dp_shard"}), (std::vector<int>{0, 4}));
  EXPECT_EQ(m.group(0, {"pp"}), (std::vector<int>{0, 8}));
  EXPECT_EQ(m.group(13, {"tp"}), (std::vector<int>{12, 13}));
  EXPECT_EQ(m.coord(13, "pp"), 1);
  EXPECT_EQ(m.coord(13, "dp_shard"), 1);
  EXPECT_EQ(m.coord(13, "cp"), 0);
  EXPECT_EQ(m.coord(13, "tp"), 1);
  EXPECT_EQ(m.rank_of({{"pp", 1}, {"dp_shard", 1}, {"tp", 1}}), 13);
  EXPECT_EQ(m.size("dp_replicate"), 1) << "a dimension the job does not use has degree 1";
  EXPECT_EQ(m.describe(), "pp 2 x dp_shard 2 x cp 2 x tp 2 (16 ranks)");
}

// Every rank, every set of dimensions, on meshes with uneven degrees (3 and 4 ranks along a
// dimension, where 2 hides an index error), against a tensor laid out as init_device_mesh does.
TEST(Mesh, EveryGroupMatchesARowMajorTensorOfRanks) {
  const auto& order = Mesh::order();
  for (const std::vector<int>& degrees : std::vector<std::vector<int>>{
           {1, 2, 3, 1, 2}, {2, 1, 1, 3, 2}, {1, 1, 4, 3, 1}, {3, 2, 1, 1, 2}}) {
    std::vector<MeshDim> dims;
    int world = 1;
    for (size_t i = 0; i < order.size(); ++i) {
      dims.push_back({order[i], degrees[i], "--" + order[i]});
      world *= degrees[i];
    }
    const Mesh m = Mesh::build(world, dims);
    std::vector<int64_t> shape(degrees.begin(), degrees.end());
    const torch::Tensor grid = torch::arange(world, torch::kLong).view(shape);
    for (int rank = 0; rank < world; ++rank) {
      // The rank's coordinates, read off the tensor.
      const torch::Tensor at = (grid == rank).nonzero()[0];
      for (size_t i = 0; i < order.size(); ++i) {
        ASSERT_EQ(m.coord(rank, order[i]), at[static_cast<int64_t>(i)].item<int64_t>())
            << "rank " << rank << ", " << order[i];
      }
      for (unsigned mask = 0; mask < (1u << order.size()); ++mask) {
        std::vector<std::string> set;
        std::vector<at::indexing::TensorIndex> index;
        for (size_t i = 0; i < order.size(); ++i) {
          if (mask & (1u << i)) {
            set.push_back(order[i]);
            index.emplace_back(at::indexing::Slice());
          } else {
            index.emplace_back(at[static_cast<int64_t>(i)].item<int64_t>());
          }
        }
        const torch::Tensor members = std::get<0>(grid.index(index).flatten().sort());
        const std::vector<int64_t> want(members.data_ptr<int64_t>(),
                                        members.data_ptr<int64_t>() + members.numel());
        const std::vector<int> got = m.group(rank, set);
        ASSERT_EQ(std::vector<int64_t>(got.begin(), got.end()), want)
            << "rank " << rank << ", mask " << mask << " on " << m.describe();
        // The rank's flattened coordinate is its index in the group (its rank in the comm).
        const auto pos = std::find(got.begin(), got.end(), rank) - got.begin();
        ASSERT_EQ(m.coord(rank, set), pos) << "rank " << rank << ", mask " << mask;
        ASSERT_EQ(m.size(set), static_cast<int>(got.size()));
      }
    }
  }
}

TEST(Mesh, OneDegreeIsInferredFromTheWorldSize) {
  const Mesh m = Mesh::build(12, {{"dp_shard", 0, "--dp"}, {"tp", 2, "--tp"}, {"cp", 3, "--cp"}});
  EXPECT_EQ(m.size("dp_shard"), 2);
  EXPECT_EQ(m.size("cp"), 3);
  EXPECT_EQ(m.size(std::vector<std::string>{"dp_shard", "cp"}), 6);
  EXPECT_EQ(Mesh::build(1, {}).describe(), "one rank (1 rank)");
}

TEST(Mesh, BadDegreesAreUsageErrorsNamingTheFlag) {
  const std::string negative = subject_of(4, {{"tp", -1, "--tp"}});
  EXPECT_EQ(negative.rfind("--tp | ", 0), 0u) << negative;
  EXPECT_NE(negative.find("at least 1"), std::string::npos) << negative;

  const std::string mismatch = subject_of(4, {{"dp_shard", 2, "--dp"}, {"tp", 3, "--tp"}});
  EXPECT_EQ(mismatch.rfind("--tp | ", 0), 0u) << mismatch;
  EXPECT_NE(mismatch.find("--dp 2 x --tp 3 needs 6 ranks, but this run has 4"), std::string::npos)
      << mismatch;
  EXPECT_NE(mismatch.find("--nproc_per_node 6"), std::string::npos) << mismatch;

  const std::string indivisible = subject_of(6, {{"dp_shard", 0, "--dp"}, {"tp", 4, "--tp"}});
  EXPECT_EQ(indivisible.rfind("--tp | ", 0), 0u)
      << "the flag given, not the one inferred: " << indivisible;
  EXPECT_NE(indivisible.find("needs a multiple of 4 ranks, but this run has 6"), std::string::npos)
      << indivisible;

  EXPECT_EQ(subject_of(6, {{"dp_shard", 4, "--dp"}, {"tp", 0, "--tp"}}).rfind("--dp | ", 0), 0u);

  const std::string two_inferred = subject_of(4, {{"dp_shard", 0, "--dp"}, {"cp", 0, "--cp"}});
  EXPECT_EQ(two_inferred.rfind("--cp | ", 0), 0u) << two_inferred;

  EXPECT_EQ(subject_of(4, {{"ep", 4, "--ep"}}).rfind("--ep | ", 0), 0u)
      << "not a mesh dimension (expert parallelism is a flattened group, not a dimension)";
  EXPECT_EQ(subject_of(4, {{"tp", 2, "--tp"}, {"tp", 2, "--tp2"}}).rfind("--tp2 | ", 0), 0u);
  EXPECT_THROW(Mesh::build(4, {{"tp", 4, "--tp"}}).group(4, {"tp"}), std::out_of_range);
  EXPECT_THROW(Mesh::build(4, {{"tp", 4, "--tp"}}).coord(0, "ep"), std::invalid_argument);
}

// A flag left at its default of 1 is not blamed for another's degree: lesson 10's --dp 4 on 6
// ranks with cp inferred (and --tp at its default 1) names --dp, and does not list --tp 1.
TEST(Mesh, ADefaultDegreeOf1IsNotBlamed) {
  const std::string msg =
      subject_of(6, {{"dp_replicate", 4, "--dp"}, {"tp", 1, "--tp"}, {"cp", 0, "--cp"}});
  EXPECT_EQ(msg.rfind("--dp | ", 0), 0u) << msg;
  EXPECT_NE(msg.find("--dp 4 needs a multiple of 4 ranks, but this run has 6"), std::string::npos)
      << msg;
  EXPECT_EQ(msg.find("--tp 1"), std::string::npos) << msg;
  // Every degree 1 on 2 ranks: the last one given is at fault.
  EXPECT_EQ(subject_of(2, {{"dp_shard", 1, "--dp"}, {"tp", 1, "--tp"}}).rfind("--tp | ", 0), 0u);
}

// A set of dimensions is checked where it is used: an unknown name is not skipped, a repeated one
// does not square its degree, and a rank or coordinate outside the mesh throws.
TEST(Mesh, SetsAndRanksOutsideTheMeshThrow) {
  const Mesh m = Mesh::build(8, {{"dp_shard", 2, "--dp"}, {"cp", 2, "--cp"}, {"tp", 2, "--tp"}});
  const std::vector<std::string> unknown = {"dp_shard", "ep"};
  const std::vector<std::string> repeated = {"tp", "tp"};
  EXPECT_THROW(m.size(unknown), std::invalid_argument);
  EXPECT_THROW(m.size(repeated), std::invalid_argument);
  EXPECT_THROW(m.coord(0, unknown), std::invalid_argument);
  EXPECT_THROW(m.coord(0, repeated), std::invalid_argument);
  EXPECT_THROW(m.group(0, repeated), std::invalid_argument);
  EXPECT_THROW(m.group_name(0, unknown), std::invalid_argument);
  EXPECT_THROW(Mesh::key(unknown), std::invalid_argument);
  EXPECT_EQ(Mesh::key({"tp", "dp_shard"}), "dp_shard+tp");
  EXPECT_THROW(m.coord(8, "tp"), std::out_of_range);
  EXPECT_THROW(m.coord(-1, std::vector<std::string>{"tp"}), std::out_of_range);
  EXPECT_THROW(m.rank_of({{"tp", 2}}), std::out_of_range);
  EXPECT_THROW(m.rank_of({{"cp", -1}}), std::out_of_range);
  EXPECT_THROW(m.rank_of({{"ep", 0}}), std::invalid_argument);
  EXPECT_EQ(m.rank_of({{"dp_shard", 1}, {"tp", 1}}), 5);
}

// One store-prefix rule for every group: its dimensions in the mesh's order, its members.
TEST(Mesh, GroupNamesSayTheDimensionsAndTheMembers) {
  const Mesh m = Mesh::build(8, {{"tp", 2, "--tp"}, {"cp", 2, "--cp"}, {"dp_shard", 2, "--dp"}});
  EXPECT_EQ(m.group_name(1, {"cp", "dp_shard"}), "dp_shard+cp/1-3-5-7");
  EXPECT_EQ(m.group_name(6, {"tp"}), "tp/6-7");
  EXPECT_EQ(m.group_name(6, {}), "self/6");
}

// Every rank builds its communicators; a collective in each sums exactly its group's members.
TEST(MeshGroups, EachCommunicatorSpansItsGroupWithTheRankAtItsCoordinate) {
  const Mesh m = Mesh::build(6, {{"dp_shard", 0, "--dp"}, {"tp", 3, "--tp"}});
  const std::vector<std::vector<std::string>> sets = {{"tp"}, {"dp_shard"}, {"dp_shard", "tp"}};
  run_ranks(6, [&](RankContext& ctx) {
    const MeshGroups groups(ctx.store, m, ctx.rank, sets, BackendKind::kGloo,
                            std::chrono::seconds(10));
    for (const auto& set : sets) {
      const auto& comm = groups.get(set);
      ASSERT_TRUE(comm) << "rank " << ctx.rank;
      EXPECT_EQ(comm->getSize(), m.size(set));
      EXPECT_EQ(comm->getRank(), m.coord(ctx.rank, set));
      std::vector<at::Tensor> t{torch::full({3}, static_cast<double>(ctx.rank), torch::kDouble)};
      comm->allreduce(t)->wait();
      double want = 0;
      for (int r : m.group(ctx.rank, set)) want += r;
      EXPECT_EQ(t[0][0].item<double>(), want) << "rank " << ctx.rank;
    }
    EXPECT_THROW(groups.get({"cp"}), std::out_of_range);
    EXPECT_THROW(groups.get({"tp", "tp"}), std::invalid_argument);
    EXPECT_EQ(groups.get({"tp", "dp_shard"}).get(), groups.get({"dp_shard", "tp"}).get())
        << "a set is the same set in any order";
  });
}

// A set asked for twice (in any order) is built once: a second communicator under the same store
// prefix would meet the first one's keys. Each still sums its group.
TEST(MeshGroups, ASetAskedTwiceIsBuiltOnce) {
  const Mesh m = Mesh::build(4, {{"dp_shard", 2, "--dp"}, {"tp", 2, "--tp"}});
  const std::vector<std::vector<std::string>> sets = {
      {"tp"}, {"dp_shard", "tp"}, {"tp"}, {"tp", "dp_shard"}};
  run_ranks(4, [&](RankContext& ctx) {
    const MeshGroups groups(ctx.store, m, ctx.rank, sets, BackendKind::kGloo,
                            std::chrono::seconds(10));
    for (const auto& set : sets) {
      std::vector<at::Tensor> t{torch::ones({1}, torch::kDouble)};
      groups.get(set)->allreduce(t)->wait();
      EXPECT_EQ(t[0].item<double>(), m.size(set)) << Mesh::key(set);
    }
  });
}

}  // namespace
}  // namespace dtc
