// dtc/mix.h: the planner's mix grammar, parsed, written back and checked against a model.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dtc/errors.h"
#include "dtc/mix.h"

namespace dtc {
namespace {

// The subject and the first line of a UsageError thrown by @p f, or "" when none is thrown.
template <class F>
std::string usage_error(F&& f) {
  try {
    f();
  } catch (const UsageError& e) {
    const std::string what = e.what();
    return e.subject() + " | " + what.substr(0, what.find('\n'));
  }
  return "";
}

TEST(Mix, FieldsLeftOutKeepTheirDefaults) {
  const MixSpec m = parse_mix("2x4x8x1", "--mix");
  EXPECT_EQ(m.dp, 2);
  EXPECT_EQ(m.tp, 4);
  EXPECT_EQ(m.pp, 8);
  EXPECT_EQ(m.cp, 1);
  EXPECT_EQ(m.world(), 64);
  EXPECT_EQ(m.zero_stage, 0);
  EXPECT_EQ(m.shard, 0);
  EXPECT_EQ(m.recompute, "none");
  EXPECT_EQ(m.micro_batch, 1);
  EXPECT_EQ(m.virtual_stages, 1);
  EXPECT_EQ(m.text(), "2x4x8x1:0:none:1:1");
}

TEST(Mix, EveryFieldAndHsdp) {
  const MixSpec m = parse_mix("4x1x2x1:hsdp2:full:3:2", "--mix");
  EXPECT_EQ(m.zero_stage, 3) << "hsdpN is ZeRO-3 sharded over groups of N";
  EXPECT_EQ(m.shard, 2);
  EXPECT_EQ(m.recompute, "full");
  EXPECT_EQ(m.micro_batch, 3);
  EXPECT_EQ(m.virtual_stages, 2);
  EXPECT_EQ(m.text(), "4x1x2x1:hsdp2:full:3:2");
  for (const std::string text : {"1x1x1x1:0:none:1:1", "128x8x16x1:1:selective:1:8",
                                 "2x2x2x2:3:full:4:1", "8x1x1x1:hsdp4:none:2:1"}) {
    EXPECT_EQ(parse_mix(text, "--mix").text(), text) << "text() gives the mix back";
  }
}

TEST(Mix, WhatIsNotAMixNamesTheFlag) {
  for (const std::string text :
       {"", "8x1x1", "8x1x1x1x1", "2x2x2x2:4", "2x2x2x2:1:some", "2x2x2x2:1:none:x", "0x2x2x2",
        "2x0x2x2", "2x2x0x2", "2x2x2x0", "2x2x2x2:1:none:0", "2x2x2x2:1:none:1:0", "2x2x2x2:hsdp1",
        "2x2x2x2:hsdp0", "99999999999x1x1x1", " 2x2x2x2", "2X2X2X2", "384773x49477x34724x55810",
        "65536x65536x1x1"}) {
    SCOPED_TRACE(text);
    const std::string err = usage_error([&] { parse_mix(text, "--mix"); });
    EXPECT_EQ(err.rfind("--mix | --mix: ", 0), 0u) << err;
  }
}

TEST(Mix, TheMessageNamesTheFieldAndTheFlagGiven) {
  const std::string err = usage_error([] { parse_mix("2x2x0x2", "--compare"); });
  EXPECT_EQ(err, "--compare | --compare: '2x2x0x2' has PP 0, below 1");
  EXPECT_EQ(parse_mix("32768x65536x1x1", "--mix").world(), int64_t{1} << 31) << "2^31 is allowed";
  EXPECT_EQ(usage_error([] {
              check_mix(parse_mix("2x1x1x1", "--plan-mix"), MixShape{8, 4, 64, 4}, "--plan-mix");
            }).rfind("--plan-mix | ", 0),
            0u);
}

TEST(Mix, TheEdgesOfEachRule) {
  const auto fits = [](const std::string& text, const MixShape& shape) {
    return usage_error([&] { check_mix(parse_mix(text, "--mix"), shape, "--mix"); });
  };
  EXPECT_EQ(fits("1x1x8x1", MixShape{8, 4, 64, 8}), "") << "a stage of one layer";
  EXPECT_NE(fits("1x3x1x1", MixShape{8, 4, 64, 3}), "") << "tp 3 does not divide 4 heads";
  // 10 layers, pp 4: lesson 01's planner allows uneven stages, lesson 09's chunks must be equal.
  EXPECT_NE(fits("1x1x4x1:0:none:1:2", MixShape{10, 4, 64, 4}).find("equal chunks"),
            std::string::npos);
  EXPECT_EQ(fits("1x1x2x1:0:none:1:5", MixShape{10, 4, 64, 2}), "");
  // The batch: dp x micro-batch rows, and interleaving's groups of pp micro-batches.
  EXPECT_EQ(fits("2x1x2x1:0:none:2:2", MixShape{8, 4, 64, 4, 16}), "");  // 4 micro-batches
  EXPECT_NE(fits("2x1x2x1:0:none:3:1", MixShape{8, 4, 64, 4, 16}).find("= 6 rows"),
            std::string::npos);
  EXPECT_NE(fits("2x1x2x1:0:none:2:2", MixShape{8, 4, 64, 4, 12}).find("groups of pp 2"),
            std::string::npos);
  EXPECT_EQ(fits("2x1x2x1:0:none:2:1", MixShape{8, 4, 64, 4, 12}), "") << "1F1B: any count";
}

TEST(Mix, AMixThatDoesNotFitTheModelSaysWhy) {
  const MixShape shape{8, 4, 64, 8};  // 8 layers, 4 heads, 64 tokens, 8 ranks
  EXPECT_EQ(usage_error([&] { check_mix(parse_mix("2x2x2x1", "--mix"), shape, "--mix"); }), "");
  EXPECT_EQ(
      usage_error([&] { check_mix(parse_mix("1x2x2x2:0:none:1:2", "--mix"), shape, "--mix"); }),
      "");
  EXPECT_EQ(usage_error([&] { check_mix(parse_mix("4x1x2x1:hsdp2", "--mix"), shape, "--mix"); }),
            "");
  const std::vector<std::pair<std::string, std::string>> misfits = {
      {"2x2x1x1", "needs dp x tp x pp x cp = 4 ranks, but 8 were launched"},
      {"1x8x1x1", "tp 8 does not divide the model's 4 heads"},
      {"8x1x1x1:0:none:1:2", "2 virtual stages need a pipeline, but pp is 1"},
      {"1x1x8x1:0:none:1:2", "2 virtual stages need the 8 layers in pp x 2 = 16 equal chunks"},
      {"2x1x1x4", ""},  // 64 tokens over cp 4: fits
      {"4x1x2x1:hsdp3", "HSDP over groups of 3 needs cp 1 and a group that divides dp 4"},
      {"2x1x2x2:hsdp2", "HSDP over groups of 2 needs cp 1"},
  };
  for (const auto& misfit : misfits) {
    const std::string& text = misfit.first;
    const std::string& why = misfit.second;
    SCOPED_TRACE(text);
    const std::string err =
        usage_error([&] { check_mix(parse_mix(text, "--mix"), shape, "--mix"); });
    if (why.empty()) {
      EXPECT_EQ(err, "");
    } else {
      EXPECT_NE(err.find(why), std::string::npos) << err;
      EXPECT_EQ(err.rfind("--mix | ", 0), 0u) << err;
    }
  }
  EXPECT_NE(usage_error([&] {
              check_mix(parse_mix("1x1x16x1", "--mix"), MixShape{8, 4, 64, 16}, "--mix");
            }).find("pp 16 is more stages than the model's 8 layers"),
            std::string::npos);
  EXPECT_NE(usage_error([&] {
              check_mix(parse_mix("1x1x1x3", "--mix"), MixShape{8, 4, 64, 3}, "--mix");
            }).find("cp 3 does not divide the sequence of 64 tokens"),
            std::string::npos);
}

}  // namespace
}  // namespace dtc
