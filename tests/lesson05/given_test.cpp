// Lesson 05 tests of code given in full (suites ...Given pass before you start): fingerprints and
// their encoding, the doctor on made-up environments and a made-up machine, and the NCCL log
// parser on the constructed samples of tests/lesson05/data/ (expected values counted by hand
// from those files; see data/README.md).
//   build/tests/lesson05_tests --gtest_filter='*Given*'
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>

#include "debug_aids.h"
#include "doctor.h"
#include "nccl_log.h"
#include "program.h"

#include "dtc/data.h"  // dtc::source_path: the constructed logs in tests/lesson05/data

namespace dtc::l05 {
namespace {

// --- fingerprints -----------------------------------------------------------------------------

TEST(L05FingerprintGiven, OfTensors) {
  auto fp = fingerprint_of(3, "allreduce", {torch::zeros({4, 8}), torch::zeros({2}, torch::kLong)});
  EXPECT_EQ(fp.seq, 3);
  EXPECT_EQ(fp.shapes, (std::vector<std::vector<int64_t>>{{4, 8}, {2}}));
  EXPECT_EQ(fp.dtypes, (std::vector<std::string>{"Float", "Long"}));
  EXPECT_EQ(fp.describe(), "#3 allreduce(Float[4, 8], Long[2])");
}

TEST(L05FingerprintGiven, EncodeDecodeRoundTrip) {
  auto fp = fingerprint_of(12, "broadcast(root=1)", {torch::zeros({3, 1, 5}), torch::zeros({})});
  EXPECT_EQ(fp.encode(), "12|broadcast(root=1)|Float:3x1x5;Float:");
  EXPECT_EQ(Fingerprint::decode(fp.encode()), fp);
  EXPECT_NE(Fingerprint::decode("12|allreduce|Float:3x1x5;Float:"), fp);
  EXPECT_THROW(Fingerprint::decode("garbage"), std::invalid_argument);
}

TEST(L05FingerprintGiven, Keys) {
  EXPECT_EQ(barrier_key("start", 3), "barrier/start/3");
  EXPECT_EQ(fingerprint_key(7, 1), "fingerprint/7/1");
  EXPECT_EQ(join_ranks({1, 3, 4}), "1, 3, 4");
}

// --- the doctor -----------------------------------------------------------------------------

using Env = std::map<std::string, std::string>;

EnvLookup lookup(Env vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

// A machine with interfaces lo, eth0, eth1, ib0; "node0" and "127.0.0.1" resolve; something
// listens at 127.0.0.1:29500 only.
Machine fake_machine() {
  Machine m;
  m.interfaces = [] { return std::vector<std::string>{"lo", "eth0", "eth1", "ib0"}; };
  m.resolves = [](const std::string& h) { return h == "node0" || h == "127.0.0.1"; };
  m.listening = [](const std::string& h, int p) { return h == "127.0.0.1" && p == 29500; };
  return m;
}

// The subjects of the findings of @p severity.
std::multiset<std::string> subjects(const std::vector<Finding>& f, Severity severity) {
  std::multiset<std::string> out;
  for (const auto& x : f) {
    if (x.severity == severity) out.insert(x.subject);
  }
  return out;
}

TEST(L05DoctorGiven, CleanEnvironmentHasNoFindings) {
  auto f = run_doctor(lookup({}), fake_machine());
  EXPECT_TRUE(f.empty());
  EXPECT_EQ(worst(f), Severity::kOk);
}

TEST(L05DoctorGiven, InterfaceNames) {
  auto f = run_doctor(lookup({{"GLOO_SOCKET_IFNAME", "eth9"}, {"NCCL_SOCKET_IFNAME", "eth"}}),
                      fake_machine());
  EXPECT_EQ(subjects(f, Severity::kError), std::multiset<std::string>{"GLOO_SOCKET_IFNAME"});
  // "eth" matches eth0 and eth1: NCCL may use either (and another node the other one).
  EXPECT_EQ(subjects(f, Severity::kWarning), std::multiset<std::string>{"NCCL_SOCKET_IFNAME"});
  EXPECT_NE(f[0].fix.find("lo, eth0, eth1, ib0"), std::string::npos) << f[0].fix;
  EXPECT_EQ(worst(f), Severity::kError);
  // One character: NCCL ignores it (ncclFindInterfaces reads values of 2 characters or more).
  f = run_doctor(lookup({{"NCCL_SOCKET_IFNAME", "e"}}), fake_machine());
  EXPECT_EQ(subjects(f, Severity::kWarning), std::multiset<std::string>{"NCCL_SOCKET_IFNAME"});
  // NCCL: '=' means exact ("=eth" matches nothing), '^' excludes (not checked).
  f = run_doctor(lookup({{"NCCL_SOCKET_IFNAME", "=eth"}}), fake_machine());
  EXPECT_EQ(worst(f), Severity::kError);
  f = run_doctor(lookup({{"NCCL_SOCKET_IFNAME", "^docker,lo"}, {"GLOO_SOCKET_IFNAME", "eth0,ib0"}}),
                 fake_machine());
  EXPECT_EQ(worst(f), Severity::kOk);
}

TEST(L05DoctorGiven, SocketIfnameSilentFailures) {
  Machine m = fake_machine();
  m.interfaces = [] {
    return std::vector<std::string>{"lo", "eth0", "eth0.100", "docker0", "ib0"};
  };
  auto warnings = [&](const std::string& value) {
    const auto f = run_doctor(lookup({{"NCCL_SOCKET_IFNAME", value}}), m);
    EXPECT_EQ(subjects(f, Severity::kError).size(), 0u) << value;
    return subjects(f, Severity::kWarning).size();
  };
  EXPECT_EQ(warnings("eth0"), 1u) << "eth0 is a prefix: it matches eth0.100 too";
  EXPECT_EQ(warnings("=eth0"), 0u);
  EXPECT_EQ(warnings("ib"), 0u);
  EXPECT_EQ(warnings("lo"), 1u) << "loopback: other nodes cannot reach it";
  EXPECT_EQ(warnings("docker"), 1u) << "a container bridge";
  EXPECT_EQ(warnings("=ib0,lo"), 1u) << "one leading = makes every name exact (NCCL docs)";
  const auto f = run_doctor(lookup({{"NCCL_SOCKET_IFNAME", "eth0"}}), m);
  ASSERT_FALSE(f.empty());
  EXPECT_NE(f[0].problem.find("eth0, eth0.100"), std::string::npos) << f[0].problem;
  EXPECT_NE(f[0].fix.find("NCCL_SOCKET_IFNAME==eth0"), std::string::npos) << f[0].fix;
}

TEST(L05DoctorGiven, AlgoAndProtoPerCollective) {
  // The syntax of NCCL's parseList (src/graph/tuning.cc): entries split by ';', each but the
  // first named by its collective, elements case-insensitive, '^' to exclude.
  for (const char* ok : {"ring", "Ring,Tree", "^nvls", "ring;allreduce:tree,ring",
                         "allreduce:tree;broadcast:^ring"}) {
    EXPECT_EQ(worst(run_doctor(lookup({{"NCCL_ALGO", ok}}), fake_machine())), Severity::kOk) << ok;
  }
  for (const char* bad : {"ring;tree", "allredcue:tree", "collnet", "ring,fast"}) {
    EXPECT_EQ(worst(run_doctor(lookup({{"NCCL_ALGO", bad}}), fake_machine())), Severity::kError)
        << bad;
  }
  EXPECT_EQ(worst(run_doctor(lookup({{"NCCL_PROTO", "LL,Simple;allreduce:^LL"}}), fake_machine())),
            Severity::kOk);
  EXPECT_EQ(worst(run_doctor(lookup({{"NCCL_PROTO", "LL256"}}), fake_machine())), Severity::kError);
}

TEST(L05DoctorGiven, MisspeltNamesAreNamedWithTheNearestKnownOne) {
  Machine m = fake_machine();
  m.environment = [] {
    return std::vector<std::string>{"NCCL_SOCKET_IFNAMES",
                                    "NCCL_DEBUG",
                                    "TORCH_NCCL_BLOCKING_WAITE",
                                    "NCCL_IB_SL",
                                    "NCCL_IB_TC",
                                    "HOME",
                                    "NCCL_SITE_SPECIFIC_KNOB_OF_OURS",
                                    "TORCH_FR_BUFFER_SIZE"};
  };
  const auto f = run_doctor(lookup({}), m);
  EXPECT_EQ(subjects(f, Severity::kWarning),
            (std::multiset<std::string>{"NCCL_SOCKET_IFNAMES", "TORCH_NCCL_BLOCKING_WAITE"}));
  for (const auto& x : f) {
    if (x.subject == "NCCL_SOCKET_IFNAMES") {
      EXPECT_NE(x.problem.find("did you mean NCCL_SOCKET_IFNAME?"), std::string::npos) << x.problem;
    }
  }
}

TEST(L05DoctorGiven, CudaVisibleDevices) {
  auto f = run_doctor(lookup({{"CUDA_VISIBLE_DEVICES", "0,1,0"}}), fake_machine());
  ASSERT_EQ(subjects(f, Severity::kError), std::multiset<std::string>{"CUDA_VISIBLE_DEVICES"});
  EXPECT_NE(f[0].problem.find("listed twice"), std::string::npos) << f[0].problem;
  f = run_doctor(lookup({{"CUDA_VISIBLE_DEVICES", "0, 1"}}), fake_machine());
  EXPECT_EQ(worst(f), Severity::kError) << "a space is malformed";
  f = run_doctor(lookup({{"CUDA_VISIBLE_DEVICES", "gpu0"}}), fake_machine());
  EXPECT_EQ(worst(f), Severity::kError);
  f = run_doctor(lookup({{"CUDA_VISIBLE_DEVICES", ""}}), fake_machine());
  EXPECT_EQ(worst(f), Severity::kWarning);
  f = run_doctor(lookup({{"CUDA_VISIBLE_DEVICES", "3,1,GPU-8c2f1a7e-0b3d-4e5f-9a1b-2c3d4e5f6a7b"}}),
                 fake_machine());
  EXPECT_EQ(worst(f), Severity::kOk);
}

TEST(L05DoctorGiven, MasterAddrAndPort) {
  // Before a launch (no RANK): 29500 is in use on this fake machine, 29501 is free.
  auto f =
      run_doctor(lookup({{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}}), fake_machine());
  EXPECT_EQ(subjects(f, Severity::kError), std::multiset<std::string>{"MASTER_PORT"});
  EXPECT_NE(f[0].problem.find("already in use"), std::string::npos) << f[0].problem;
  f = run_doctor(lookup({{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29501"}}), fake_machine());
  EXPECT_EQ(worst(f), Severity::kOk);
  // Inside a job (RANK set): the store must be reachable.
  f = run_doctor(lookup({{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29501"}, {"RANK", "1"}}),
                 fake_machine());
  EXPECT_EQ(subjects(f, Severity::kError), std::multiset<std::string>{"MASTER_PORT"});
  EXPECT_NE(f[0].problem.find("nothing listens"), std::string::npos) << f[0].problem;
  f = run_doctor(lookup({{"MASTER_ADDR", "nosuchhost"}, {"MASTER_PORT", "70000"}}), fake_machine());
  EXPECT_EQ(subjects(f, Severity::kError),
            (std::multiset<std::string>{"MASTER_ADDR", "MASTER_PORT"}));
}

TEST(L05DoctorGiven, WorldSizeConsistency) {
  auto f = run_doctor(lookup({{"WORLD_SIZE", "4"}, {"RANK", "4"}}), fake_machine());
  EXPECT_EQ(subjects(f, Severity::kError), std::multiset<std::string>{"RANK"});
  f = run_doctor(lookup({{"WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_SIZE", "2"}}), fake_machine());
  EXPECT_EQ(subjects(f, Severity::kError), std::multiset<std::string>{"WORLD_SIZE"});
  f = run_doctor(lookup({{"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "4"}}), fake_machine());
  EXPECT_EQ(subjects(f, Severity::kError), std::multiset<std::string>{"LOCAL_WORLD_SIZE"});
  f = run_doctor(
      lookup({{"WORLD_SIZE", "6"}, {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_WORLD_SIZE", "2"}}),
      fake_machine());
  EXPECT_EQ(worst(f), Severity::kWarning);
  f = run_doctor(lookup({{"WORLD_SIZE", "4"},
                         {"RANK", "3"},
                         {"LOCAL_WORLD_SIZE", "2"},
                         {"LOCAL_RANK", "1"},
                         {"GROUP_WORLD_SIZE", "2"}}),
                 fake_machine());
  EXPECT_EQ(worst(f), Severity::kOk);
}

TEST(L05DoctorGiven, VariableValues) {
  auto f = run_doctor(lookup({{"NCCL_DEBUG", "info"},
                              {"NCCL_DEBUG_SUBSYS", "INIT,NET,ALLOC_HOST,DESTROY"},
                              {"NCCL_P2P_DISABLE", "1"},
                              {"NCCL_IB_HCA", "mlx5_0:1,mlx5_1"},
                              {"TORCH_DISTRIBUTED_DEBUG", "DETAIL"}}),
                      fake_machine());
  EXPECT_EQ(worst(f), Severity::kOk);
  f = run_doctor(lookup({{"NCCL_DEBUG", "VERBOSE"},
                         {"NCCL_DEBUG_SUBSYS", "INIT,NETWORK"},
                         {"NCCL_SHM_DISABLE", "yes"},
                         {"NCCL_IB_HCA", "mlx5_0:x"},
                         {"TORCH_DISTRIBUTED_DEBUG", "ALL"},
                         {"TORCH_CPP_LOG_LEVEL", "DEBUG"}}),
                 fake_machine());
  EXPECT_EQ(subjects(f, Severity::kError),
            (std::multiset<std::string>{"NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_SHM_DISABLE",
                                        "NCCL_IB_HCA", "TORCH_DISTRIBUTED_DEBUG",
                                        "TORCH_CPP_LOG_LEVEL"}));
  std::ostringstream out;
  print_findings(out, f);
  EXPECT_NE(out.str().find("ERROR NCCL_DEBUG: 'VERBOSE' is not a valid value"), std::string::npos)
      << out.str();
}

TEST(L05DoctorGiven, ExitCodeIsTheWorstFinding) {
  std::ostringstream out, err;
  const char* argv[] = {"lesson05", "doctor"};
  EXPECT_EQ(run_program(2, argv, out, err, lookup({{"CUDA_VISIBLE_DEVICES", "0,0"}})), 2)
      << out.str();
  EXPECT_EQ(run_program(2, argv, out, err, lookup({{"CUDA_VISIBLE_DEVICES", ""}})), 1) << out.str();
  EXPECT_EQ(run_program(2, argv, out, err, lookup({{"NCCL_DEBUG", "INFO"}})), 0) << out.str();
}

// --- the NCCL log parser --------------------------------------------------------------------

NcclLogSummary parse_sample(const std::string& name) {
  std::ifstream in(dtc::source_path("tests/lesson05/data/" + name));
  EXPECT_TRUE(in.good()) << name;
  return parse_nccl_log(in);
}

TEST(L05NcclLogGiven, OneNodeP2P) {
  auto s = parse_sample("nccl_1node_2gpu_p2p.log");
  EXPECT_EQ(s.version, "2.21.5");
  EXPECT_EQ(s.cuda, "12.4");
  EXPECT_EQ(s.network, "Socket");
  ASSERT_EQ(s.comms.size(), 2u);  // one comm object per process: two addresses
  EXPECT_EQ(s.comms[0].nranks, 2);
  EXPECT_EQ(s.comms[0].nnodes, 1);
  EXPECT_EQ(s.comms[0].local_ranks, 2);
  EXPECT_EQ(s.channels, 2);
  EXPECT_EQ(s.rings.at(0), (std::vector<int>{0, 1}));
  EXPECT_EQ(s.rings.at(1), (std::vector<int>{0, 1}));
  EXPECT_EQ(s.trees.at(0), (std::vector<std::string>{"1/-1/-1->0->-1", "-1/-1/-1->1->0"}));
  EXPECT_EQ(s.transports, (std::map<std::string, int>{{"P2P/CUMEM/read", 4}}));
  EXPECT_EQ(s.transport_families, (std::map<std::string, int>{{"P2P", 4}}));
  EXPECT_TRUE(s.warnings.empty());
  EXPECT_EQ(s.lines, 29);       // wc -l
  EXPECT_EQ(s.nccl_lines, 24);  // grep -c "NCCL INFO\\|NCCL WARN"
}

TEST(L05NcclLogGiven, TwoNodesInfiniBand) {
  auto s = parse_sample("nccl_2node_4gpu_ib.log");
  EXPECT_EQ(s.version, "2.20.3");
  EXPECT_EQ(s.network, "IB");
  ASSERT_EQ(s.comms.size(), 4u);
  EXPECT_EQ(s.comms[3].nranks, 4);
  EXPECT_EQ(s.comms[3].nnodes, 2);
  EXPECT_EQ(s.comms[3].ranks_seen, (std::vector<int>{3}));
  EXPECT_EQ(s.rings.at(1), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(s.trees.at(1).size(), 4u);
  EXPECT_EQ(s.transport_families, (std::map<std::string, int>{{"NET/IB", 8}, {"P2P", 4}}));
  EXPECT_EQ(s.transports.at("NET/IB/0/GDRDMA"), 8);
}

TEST(L05NcclLogGiven, LinksAndHosts) {
  auto s = parse_sample("nccl_2node_4gpu_ib.log");
  ASSERT_EQ(s.links.size(), 12u);  // grep -c " via " nccl_2node_4gpu_ib.log
  EXPECT_EQ(s.links[0].channel, 0);
  EXPECT_EQ(s.links[0].from, 0);
  EXPECT_EQ(s.links[0].to, 1);
  EXPECT_EQ(s.links[0].side, "");
  EXPECT_EQ(s.links[0].via, "P2P/CUMEM/read");
  EXPECT_EQ(s.links[0].family, "P2P");
  EXPECT_EQ(s.links[2].channel, 0);
  EXPECT_EQ(s.links[2].from, 1);
  EXPECT_EQ(s.links[2].to, 2);
  EXPECT_EQ(s.links[2].side, "send");
  EXPECT_EQ(s.links[2].family, "NET/IB");
  EXPECT_EQ(s.links[4].side, "receive");
  EXPECT_EQ(s.hosts,
            (std::map<int, std::string>{{0, "node0"}, {1, "node0"}, {2, "node1"}, {3, "node1"}}));
  // A launcher's own prefix before NCCL's is skipped; a line without NCCL's prefix gives no host.
  std::istringstream text(
      "[rank1]:gpu7:12:34 [1] NCCL INFO comm 0x1 rank 1 nRanks 2 nNodes 1 localRanks 2\n"
      "NCCL INFO comm 0x2 rank 0 nRanks 2 nNodes 1 localRanks 2\n");
  EXPECT_EQ(parse_nccl_log(text).hosts, (std::map<int, std::string>{{1, "gpu7"}}));
}

TEST(L05NcclLogGiven, SocketsOnOneNodeGiveAHint) {
  auto s = parse_sample("nccl_1node_2gpu_socket.log");
  EXPECT_EQ(s.channels, 1);
  EXPECT_EQ(s.transport_families, (std::map<std::string, int>{{"NET/Socket", 4}}));
  ASSERT_EQ(s.warnings.size(), 1u);
  EXPECT_EQ(s.warnings[0], "NET/Socket : peer 10.0.0.5<41235> shutting down");
  std::ostringstream out;
  print_nccl_summary(out, s);
  EXPECT_NE(out.str().find("NCCL_P2P_DISABLE=1"), std::string::npos) << out.str();
}

TEST(L05NcclLogGiven, NotAnNcclLog) {
  std::istringstream in("hello\nworld\n");
  auto s = parse_nccl_log(in);
  EXPECT_EQ(s.lines, 2);
  EXPECT_EQ(s.nccl_lines, 0);
  EXPECT_TRUE(s.version.empty());
}

// --- one-process fault cases (given code only) ------------------------------------------------

TEST(L05FaultGiven, PortInUseIsDiagnosed) {
  std::ostringstream out, err;
  const char* argv[] = {"lesson05", "fault", "--case", "port-in-use"};
  EXPECT_EQ(run_program(4, argv, out, err, lookup({})), 1);
  EXPECT_NE(err.str().find("DIAGNOSIS: MASTER_PORT"), std::string::npos) << err.str();
  EXPECT_NE(err.str().find("already in use"), std::string::npos) << err.str();
}

TEST(L05FaultGiven, BadInterfaceIsDiagnosed) {
  std::ostringstream out, err;
  const char* argv[] = {"lesson05", "fault", "--case", "bad-ifname", "--ifname", "nosuch0"};
  EXPECT_EQ(run_program(6, argv, out, err, lookup({})), 1);
  EXPECT_NE(err.str().find("DIAGNOSIS: GLOO_SOCKET_IFNAME=nosuch0 does not exist"),
            std::string::npos)
      << err.str();
  EXPECT_NE(err.str().find("doctor: GLOO_SOCKET_IFNAME"), std::string::npos) << err.str();
}

TEST(L05FaultGiven, MultiRankCaseWithoutLauncherSaysWhatToRun) {
  std::ostringstream out, err;
  const char* argv[] = {"lesson05", "fault", "--case", "shape-mismatch"};
  EXPECT_EQ(run_program(4, argv, out, err, lookup({})), 2);
  EXPECT_NE(err.str().find("torchrun"), std::string::npos) << err.str();
}

}  // namespace
}  // namespace dtc::l05
