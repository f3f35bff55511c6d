// Lesson 11's program and checks: bad input is exit 2 naming the flag, before any networking;
// a one-rank run's --json has the keys scripts read and the single device's parameter digest.
#include <gtest/gtest.h>

#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "digest_close.h"
#include "dtc/digest.h"
#include "dtc/errors.h"
#include "dtc_test.h"
#include "nd.h"
#include "plain_baseline.h"
#include "program.h"
#include "program_run.h"

namespace dtc::l11 {
namespace {

NdOptions small(const std::string& mix) {
  NdOptions o;
  o.model.layers = 4;
  o.model.hidden = 32;
  o.model.heads = 2;
  o.model.ctx = 16;
  o.batch = 8;
  o.mix = parse_mix(mix, "--mix");
  return o;
}

// The flag each impossible mesh names, checked for the world size it would run on.
TEST(L11ChecksGiven, EveryImpossibleMeshNamesItsFlag) {
  struct Case {
    std::string mix;
    int world;
    l09::ScheduleKind schedule;
    std::string flag;
  };
  const std::vector<Case> cases = {
      {"2x2x2x1", 4, l09::ScheduleKind::k1f1b, "--mix"},        // not the world size
      {"1x4x1x1", 4, l09::ScheduleKind::k1f1b, "--mix"},        // tp 4 does not divide 2 heads
      {"1x1x8x1", 8, l09::ScheduleKind::k1f1b, "--mix"},        // more stages than layers
      {"1x1x1x3", 3, l09::ScheduleKind::k1f1b, "--mix"},        // cp 3 does not divide 16
      {"4x1x1x1:hsdp3", 4, l09::ScheduleKind::k1f1b, "--mix"},  // 3 does not divide dp 4
      {"2x1x1x2:hsdp2", 4, l09::ScheduleKind::k1f1b, "--mix"},  // HSDP with cp
      {"1x1x2x1:0:selective", 2, l09::ScheduleKind::k1f1b, "--mix"},
      {"1x1x2x1:0:none:1:3", 2, l09::ScheduleKind::k1f1b, "--mix"},  // 4 layers, 2 x 3 chunks
      {"1x1x2x1:0:none:1:2", 2, l09::ScheduleKind::kZbH1, "--schedule"},
      {"1x1x2x1", 2, l09::ScheduleKind::kInterleaved, "--schedule"},
      {"1x1x2x1:0:full", 2, l09::ScheduleKind::kZbH1, "--schedule"},
  };
  for (const Case& c : cases) {
    NdOptions o = small(c.mix);
    o.schedule = c.schedule;
    try {
      check_nd(o, c.world);
      ADD_FAILURE() << c.mix << " on " << c.world << " ranks was accepted";
    } catch (const UsageError& e) {
      EXPECT_EQ(e.subject(), c.flag) << c.mix << ": " << e.what();
    }
  }
  // Lesson 10's rules under cp, on the heads one tp rank holds: Ulysses needs them divisible by cp
  // (2 heads / tp 2 = 1 head a rank, cp 2), and zig-zag does not apply to Ulysses.
  NdOptions u = small("1x2x1x2");
  u.attention = l10::Attention::kUlysses;
  try {
    check_nd(u, 4);
    ADD_FAILURE() << "Ulysses over cp 2 with one head a tp rank was accepted";
  } catch (const UsageError& e) {
    EXPECT_EQ(e.subject(), "--heads") << e.what();
  }
  u = small("1x1x1x2");
  u.attention = l10::Attention::kUlysses;
  u.zigzag = true;
  EXPECT_THROW(check_nd(u, 2), UsageError);
  u.zigzag = false;
  EXPECT_NO_THROW(check_nd(u, 2));  // 2 heads over cp 2
  NdOptions o = small("2x2x2x1");
  o.clip = -1;
  EXPECT_THROW(check_nd(o, 8), UsageError);
  o.clip = 1;
  EXPECT_NO_THROW(check_nd(o, 8));
  EXPECT_NO_THROW(check_nd(small("2x2x2x1:2"), 8));  // ZeRO-2 and 3 and HSDP compose
  EXPECT_NO_THROW(check_nd(small("2x2x2x1:3"), 8));
  EXPECT_NO_THROW(check_nd(small("4x2x1x1:hsdp2"), 8));
  // Sequence parallelism: over tp above 1, not with ZB-H1, and tp x cp dividing the sequence.
  const auto sp_error = [](NdOptions s, int world) -> std::string {
    s.sequence_parallel = true;
    try {
      check_nd(s, world);
    } catch (const UsageError& e) {
      return e.subject();
    }
    return "accepted";
  };
  EXPECT_EQ(sp_error(small("2x1x2x1"), 4), "--sequence-parallel") << "tp 1";
  NdOptions zb = small("1x2x2x1");
  zb.schedule = l09::ScheduleKind::kZbH1;
  EXPECT_EQ(sp_error(zb, 4), "--sequence-parallel") << "zb-h1";
  NdOptions odd = small("1x2x1x1");
  odd.model.ctx = 15;
  odd.model.heads = 2;
  EXPECT_EQ(sp_error(odd, 2), "--seq") << "15 tokens over tp 2";
  EXPECT_EQ(sp_error(small("1x2x2x2"), 8), "accepted");
}

TEST(L11ProgramGiven, BadInputExitsTwoNamingTheFlag) {
  ::dtc::test::clear_launch_env();  // one rank
  const std::vector<::dtc::test::BadInput> cases = {
      {{"--mix", "2x1x1x1", "--steps", "1"}, "--mix"},
      {{"--mix", "2x2", "--steps", "1"}, "--mix"},
      {{"--mix", "1x1x1x1:hsdp0"}, "--mix"},
      {{"--hsdp", "2", "--steps", "1"}, "--hsdp"},
      {{"--hsdp", "1", "--steps", "1"}, "--hsdp"},
      {{"--sequence-parallel", "--steps", "1"}, "--sequence-parallel"},
      {{"--precision", "fp16", "--steps", "1"}, "--precision"},
      {{"--virtual-stages", "0"}, "--virtual-stages"},
      {{"--schedule", "dualpipe"}, "--schedule"},
      {{"--norm-type", "1"}, "--norm-type"},
      {{"--clip", "-1", "--steps", "1"}, "--clip"},
  };
  ::dtc::test::expect_usage_errors("lesson11", cases, run_program);
}

// One rank, --json: the keys scripts read, and the single device's parameters (the digest of
// lesson 02's model after the same steps, here in plain LibTorch with clip_grad_norm_).
TEST(L11Program, JsonOfAOneRankRunHasTheSingleDevicesDigest) {
  ::dtc::test::clear_launch_env();
  const auto r =
      ::dtc::test::run_in_process("lesson11",
                                  {"--steps", "2", "--layers", "2", "--hidden", "32", "--heads",
                                   "2", "--seq", "16", "--clip", "0.5", "--json"},
                                  run_program);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = ::dtc::test::last_json_line(r.out);
  EXPECT_EQ(j.at("mix"), "1x1x1x1:0:none:1:1");
  EXPECT_EQ(j.at("world"), 1);
  EXPECT_EQ(j.at("losses").size(), 2u);
  EXPECT_EQ(j.at("grad_norms").size(), 2u);
  for (const char* key :
       {"dp", "tp", "pp", "cp", "virtual_stages", "schedule", "launcher", "param_digest",
        "micro_batches", "tied", "comm_bytes", "zero_stage", "optimizer_state_bytes", "memory"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  // The state against lesson 01's ledger: the whole tied model (2 layers: 2 x 12,704 + ln_f 64
  // + wte 8,192 + wpe 512 = 34,176 parameters, a block being 12 h^2 + 13 h) in fp32,
  // plus the head's second tensor on this one stage (V h = 8,192), which the ledger counts once.
  const auto& mem = j.at("memory");
  EXPECT_DOUBLE_EQ(mem.at("predicted").at("params").get<double>(), 4.0 * 34176);
  EXPECT_DOUBLE_EQ(mem.at("predicted").at("optimizer").get<double>(), 8.0 * 34176);
  EXPECT_EQ(mem.at("measured").at("params").get<int64_t>(), 4 * (34176 + 8192));
  EXPECT_EQ(mem.at("measured").at("grads").get<int64_t>(), 4 * (34176 + 8192));
  EXPECT_EQ(mem.at("measured").at("optimizer").get<int64_t>(), 8 * (34176 + 8192));
  EXPECT_EQ(mem.at("measured").at("zero_copies").get<int64_t>(), 0);
  RunConfig run;
  run.model.layers = 2;
  run.model.hidden = 32;
  run.model.heads = 2;
  run.model.ctx = 16;
  const auto want = ::dtc::test::plain_baseline(run, 2, 0.5, 2).digest;
  const auto& got = j.at("param_digest");
  ::dtc::test::expect_digest_close(got, want);
}

TEST(L11ProgramGiven, HelpExitsZero) {
  const char* argv[] = {"lesson11", "--help"};
  std::ostringstream out, err;
  EXPECT_EQ(run_program(2, argv, out, err), 0);
}

}  // namespace
}  // namespace dtc::l11
