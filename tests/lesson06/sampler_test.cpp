// Lesson 06 tests of the distributed sampler, against PyTorch's own
// torch.utils.data.DistributedSampler (tests/reference/lesson06_sampler.json, written by
// tests/reference/lesson06_sampler.py) and against closed-form properties.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "ddp.h"
#include "dtc/data.h"
#include "dtc/errors.h"

namespace dtc::l06 {
namespace {

const nlohmann::json& reference() {
  static const nlohmann::json j = [] {
    std::ifstream in(source_path("tests/reference/lesson06_sampler.json"));
    if (!in) throw std::runtime_error("cannot read tests/reference/lesson06_sampler.json");
    return nlohmann::json::parse(in);
  }();
  return j;
}

std::string describe(const nlohmann::json& c) {
  return "size " + std::to_string(c.at("size").get<int64_t>()) + ", world " +
         std::to_string(c.at("world").get<int>()) + ", shuffle " + c.at("shuffle").dump() +
         ", drop_last " + c.at("drop_last").dump() + ", seed " + c.at("seed").dump() + ", epoch " +
         c.at("epoch").dump();
}

// Given code: randperm reproduces torch.randperm(n, generator=g.manual_seed(seed)).
TEST(L06SamplerGiven, RandpermIsPyTorchs) {
  for (const auto& p : reference().at("randperm")) {
    EXPECT_EQ(randperm(p.at("n"), p.at("seed")), p.at("perm").get<std::vector<int64_t>>())
        << "n " << p.at("n") << ", seed " << p.at("seed") << " (PyTorch "
        << reference().at("torch_version").get<std::string>() << ")";
  }
}

TEST(L06SamplerGiven, BadArgumentsThrowUsageError) {
  EXPECT_THROW(DistributedSampler(0, 2, 0), UsageError);
  EXPECT_THROW(DistributedSampler(10, 2, 2), UsageError);
  EXPECT_THROW(DistributedSampler(10, 0, 0), UsageError);
}

TEST(L06Sampler, IndicesAreExactlyPyTorchs) {
  for (const auto& c : reference().at("cases")) {
    const int world = c.at("world");
    for (int r = 0; r < world; ++r) {
      DistributedSampler s(c.at("size"), world, r, c.at("shuffle"), c.at("seed"),
                           c.at("drop_last"));
      s.set_epoch(c.at("epoch"));
      EXPECT_EQ(s.num_samples(), c.at("num_samples").get<int64_t>()) << describe(c);
      EXPECT_EQ(s.indices(), c.at("ranks")[static_cast<size_t>(r)].get<std::vector<int64_t>>())
          << describe(c) << ", rank " << r << " (PyTorch's DistributedSampler)";
    }
  }
}

// Closed-form properties: the ranks' shards are disjoint and cover the dataset (size divisible
// by the world: no padding), and set_epoch(1) gives another order than epoch 0.
TEST(L06Sampler, ShardsAreDisjointCoverAllAndReshufflePerEpoch) {
  const int64_t size = 60;
  const int world = 3;
  std::vector<std::vector<int64_t>> epoch_orders;
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    std::vector<int64_t> all;
    std::vector<int64_t> rank0;
    for (int r = 0; r < world; ++r) {
      DistributedSampler s(size, world, r, true, 7);
      s.set_epoch(epoch);
      const auto mine = s.indices();
      EXPECT_EQ(static_cast<int64_t>(mine.size()), size / world);
      all.insert(all.end(), mine.begin(), mine.end());
      if (r == 0) rank0 = mine;
    }
    std::sort(all.begin(), all.end());
    std::vector<int64_t> every(static_cast<size_t>(size));
    for (int64_t i = 0; i < size; ++i) every[static_cast<size_t>(i)] = i;
    EXPECT_EQ(all, every) << "epoch " << epoch << ": the shards must cover 0..59 once each";
    epoch_orders.push_back(rank0);
  }
  EXPECT_NE(epoch_orders[0], epoch_orders[1])
      << "set_epoch(1) must reshuffle: the sampler ignores the epoch (forgot seed + epoch?)";
}

TEST(L06Sampler, PaddingRepeatsTheStartAndDropLastCuts) {
  // Unshuffled, 7 samples on 3 ranks: padded to 9 with 0, 1 -> rank 0 gets 0, 3, 6; rank 1 gets
  // 1, 4, 0; rank 2 gets 2, 5, 1. drop_last: cut to 6 -> 0, 3 / 1, 4 / 2, 5.
  const std::vector<std::vector<int64_t>> padded{{0, 3, 6}, {1, 4, 0}, {2, 5, 1}};
  const std::vector<std::vector<int64_t>> dropped{{0, 3}, {1, 4}, {2, 5}};
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(DistributedSampler(7, 3, r, false).indices(), padded[static_cast<size_t>(r)]);
    EXPECT_EQ(DistributedSampler(7, 3, r, false, 0, true).indices(),
              dropped[static_cast<size_t>(r)]);
  }
}

}  // namespace
}  // namespace dtc::l06
