// Lesson 05 tests of your second part (nccl_reading.cpp): reading the transport between two ranks
// from NCCL_DEBUG=INFO logs (the constructed samples in tests/lesson05/data/, marked as such in
// each file; data/README.md), naming the variables that forced it, and NCCL's choice of socket
// interface for NCCL_SOCKET_IFNAME on made-up interface lists. The expected values come from
// NCCL's own rules: the environment variables page and src/misc/socket.cc (ncclFindInterfaces),
// src/os/linux.cc (prefix and exact matching), as README sections 2, 3 and 9 cite them.
//   build/tests/lesson05_tests --gtest_filter='L05Reading.*'
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "nccl_reading.h"

#include "dtc/data.h"  // dtc::source_path: the constructed logs in tests/lesson05/data

namespace dtc::l05 {
namespace reading_test {

using Vars = std::map<std::string, std::string>;
using Names = std::vector<std::string>;

EnvLookup env_of(Vars vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

NcclLogSummary sample(const std::string& name) {
  std::ifstream in(dtc::source_path("tests/lesson05/data/" + name));
  EXPECT_TRUE(in.good()) << name;
  return parse_nccl_log(in);
}

LinkReading link(const std::string& family, bool same_node, bool gpu_direct = false) {
  LinkReading r;
  r.from = 0;
  r.to = 1;
  r.family = family;
  r.via = family + "/0" + (gpu_direct ? "/GDRDMA" : "");
  r.same_node = same_node;
  r.gpu_direct = gpu_direct;
  return r;
}

// --- the transport between two ranks, from a log ----------------------------------------------

TEST(L05Reading, ReadLinkInsideANodeIsP2P) {
  const auto r = read_link(sample("nccl_1node_2gpu_p2p.log"), 1, 0);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->from, 1);
  EXPECT_EQ(r->to, 0);
  EXPECT_EQ(r->family, "P2P");
  EXPECT_EQ(r->via, "P2P/CUMEM/read");
  EXPECT_TRUE(r->same_node);
  EXPECT_FALSE(r->gpu_direct);
}

TEST(L05Reading, ReadLinkAcrossNodesIsInfiniBandWithGpuDirect) {
  const auto log = sample("nccl_2node_4gpu_ib.log");
  // 1 (node0) -> 2 (node1): logged by both ends, [send] and [receive].
  const auto r = read_link(log, 1, 2);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->family, "NET/IB");
  EXPECT_EQ(r->via, "NET/IB/0/GDRDMA");
  EXPECT_TRUE(r->gpu_direct);
  EXPECT_FALSE(r->same_node);
  // 2 -> 3 share node1, over P2P; 3 -> 0 crosses back to node0.
  EXPECT_TRUE(read_link(log, 2, 3)->same_node);
  EXPECT_EQ(read_link(log, 2, 3)->family, "P2P");
  EXPECT_FALSE(read_link(log, 3, 0)->same_node);
  EXPECT_EQ(read_link(log, 3, 0)->family, "NET/IB");
}

TEST(L05Reading, ReadLinkIsDirectedAndAbsentLinksAreNullopt) {
  const auto log = sample("nccl_2node_4gpu_ib.log");
  // The ring is 0 -> 1 -> 2 -> 3 -> 0: NCCL connected no 2 -> 1 and no 0 -> 2.
  EXPECT_FALSE(read_link(log, 2, 1).has_value());
  EXPECT_FALSE(read_link(log, 0, 2).has_value());
  EXPECT_FALSE(read_link(log, 0, 7).has_value());
}

TEST(L05Reading, ReadLinkSocketsInsideANode) {
  const auto r = read_link(sample("nccl_1node_2gpu_socket.log"), 0, 1);
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->family, "NET/Socket");
  EXPECT_TRUE(r->same_node);
  EXPECT_FALSE(r->gpu_direct);
}

TEST(L05Reading, ReadLinkGpuDirectOnEitherSide) {
  // The sender reads GPU memory directly only where NCCL_NET_GDR_READ allows it (by default from
  // Ampere on), the receiver writes it: the two lines of one connection can differ, NIC too.
  std::istringstream text(
      "a:1:1 [0] NCCL INFO comm 0x1 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0\n"
      "b:2:2 [0] NCCL INFO comm 0x2 rank 1 nRanks 2 nNodes 2 localRanks 1 localRank 0\n"
      "a:1:9 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0\n"
      "b:2:9 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [receive] via NET/IB/1/GDRDMA\n");
  const auto r = read_link(parse_nccl_log(text), 0, 1);
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->gpu_direct);
  EXPECT_EQ(r->via, "NET/IB/0");  // the first line's
  EXPECT_FALSE(r->same_node);
}

TEST(L05Reading, ReadLinkNeedsBothHosts) {
  // Rank 0's host is known, rank 1's is not; then the other way round.
  for (const char* known : {"0", "1"}) {
    std::istringstream text(std::string("a:1:1 [0] NCCL INFO comm 0x1 rank ") + known +
                            " nRanks 2 nNodes 1 localRanks 2 localRank 0\n"
                            "a:1:9 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC\n");
    EXPECT_THROW(read_link(parse_nccl_log(text), 0, 1), std::invalid_argument) << known;
  }
}

TEST(L05Reading, ReadLinkWithoutTheRanksHostIsAnError) {
  // A log cut to its connection lines: the hosts of the ranks are gone.
  std::istringstream cut(
      "node0:3101:3175 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n");
  const auto log = parse_nccl_log(cut);
  EXPECT_THROW(read_link(log, 0, 1), std::invalid_argument);
  EXPECT_FALSE(read_link(log, 1, 0).has_value());  // absent is absent, host or not
}

TEST(L05Reading, ReadLinkGpuDirectOnlyOverTheNetwork) {
  // "GDRDMA" is a network connection's flag; a connection line is read for its own ranks.
  std::istringstream text(
      "a:1:1 [0] NCCL INFO comm 0x1 rank 0 nRanks 4 nNodes 2 localRanks 2 localRank 0\n"
      "a:2:2 [1] NCCL INFO comm 0x2 rank 1 nRanks 4 nNodes 2 localRanks 2 localRank 1\n"
      "b:3:3 [0] NCCL INFO comm 0x3 rank 2 nRanks 4 nNodes 2 localRanks 2 localRank 0\n"
      "a:1:9 [0] NCCL INFO Channel 00/0 : 0[0] -> 2[0] [send] via NET/IB/0\n"
      "a:1:9 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n");
  const auto log = parse_nccl_log(text);
  const auto net = read_link(log, 0, 2);
  ASSERT_TRUE(net.has_value());
  EXPECT_FALSE(net->gpu_direct);
  EXPECT_FALSE(net->same_node);
  EXPECT_TRUE(read_link(log, 0, 1)->same_node);
}

// --- why that transport -------------------------------------------------------------------------

TEST(L05Reading, ExplainHealthyLinks) {
  const auto env = env_of({});
  EXPECT_TRUE(explain_link(link("P2P", true), env).healthy);
  EXPECT_TRUE(explain_link(link("NET/IB", false, true), env).healthy);
  EXPECT_TRUE(explain_link(link("P2P", false), env).healthy);  // multi-node NVLink
  EXPECT_TRUE(explain_link(link("P2P", true), env).variables.empty());
  // SHM with nothing set: the GPUs have no direct path; NCCL's fallback, not a misconfiguration.
  const auto shm = explain_link(link("SHM", true), env);
  EXPECT_TRUE(shm.healthy);
  EXPECT_TRUE(shm.variables.empty());
  EXPECT_FALSE(shm.why.empty());
}

TEST(L05Reading, ExplainSocketsInsideANodeFromTheSamplesEnvironment) {
  // The socket sample was made with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (data/README.md).
  const auto r = read_link(sample("nccl_1node_2gpu_socket.log"), 0, 1);
  ASSERT_TRUE(r.has_value());
  const auto d = explain_link(*r, env_of({{"NCCL_P2P_DISABLE", "1"}, {"NCCL_SHM_DISABLE", "1"}}));
  EXPECT_FALSE(d.healthy);
  EXPECT_EQ(d.variables, (Names{"NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"}));
  EXPECT_FALSE(d.why.empty());
}

TEST(L05Reading, ExplainNamesOnlyTheVariablesThatForcedTheStepDown) {
  // P2P off by its level, SHM off: both named, in the rules' order.
  auto d = explain_link(link("NET/Socket", true),
                        env_of({{"NCCL_SHM_DISABLE", "1"}, {"NCCL_P2P_LEVEL", "LOC"}}));
  EXPECT_EQ(d.variables, (Names{"NCCL_P2P_LEVEL", "NCCL_SHM_DISABLE"}));
  // The legacy number 0 is LOC; NVL forbids P2P between GPUs without NVLink: a reason for SHM.
  d = explain_link(link("SHM", true), env_of({{"NCCL_P2P_LEVEL", "0"}}));
  EXPECT_FALSE(d.healthy);
  EXPECT_EQ(d.variables, (Names{"NCCL_P2P_LEVEL"}));
  d = explain_link(link("SHM", true),
                   env_of({{"NCCL_P2P_LEVEL", "NVL"}, {"NCCL_SHM_DISABLE", "1"}}));
  EXPECT_FALSE(d.healthy);
  EXPECT_EQ(d.variables, (Names{"NCCL_P2P_LEVEL"}));  // SHM was used: its switch forced nothing
  // SYS (and its legacy numbers 4, 5) allows P2P at any distance: it explains nothing.
  for (const char* level : {"SYS", "4", "5"}) {
    d = explain_link(link("SHM", true), env_of({{"NCCL_P2P_LEVEL", level}}));
    EXPECT_TRUE(d.healthy) << level;
    EXPECT_TRUE(d.variables.empty()) << level;
  }
  // A switch set to 0 disables nothing; any other number does, as NCCL parses integers.
  d = explain_link(link("SHM", true), env_of({{"NCCL_P2P_DISABLE", "0"}}));
  EXPECT_TRUE(d.variables.empty());
  d = explain_link(link("SHM", true), env_of({{"NCCL_P2P_DISABLE", "1"}}));
  EXPECT_EQ(d.variables, (Names{"NCCL_P2P_DISABLE"}));
  // With P2P disabled, NCCL never reads the level: only the switch is named.
  d = explain_link(
      link("NET/Socket", true),
      env_of({{"NCCL_P2P_DISABLE", "2"}, {"NCCL_P2P_LEVEL", "LOC"}, {"NCCL_SHM_DISABLE", "1"}}));
  EXPECT_EQ(d.variables, (Names{"NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE"}));
}

TEST(L05Reading, ExplainTheNetworkInsideANodeWithNothingSet) {
  const auto d = explain_link(link("NET/Socket", true), env_of({{"NCCL_IB_DISABLE", "1"}}));
  EXPECT_FALSE(d.healthy);
  EXPECT_TRUE(d.variables.empty());  // NCCL_IB_DISABLE does not explain leaving P2P and SHM
  EXPECT_FALSE(d.why.empty());
}

TEST(L05Reading, ExplainSocketsBetweenNodes) {
  auto d = explain_link(link("NET/Socket", false), env_of({{"NCCL_IB_DISABLE", "1"}}));
  EXPECT_FALSE(d.healthy);
  EXPECT_EQ(d.variables, (Names{"NCCL_IB_DISABLE"}));
  d = explain_link(link("NET/Socket", false), env_of({{"NCCL_IB_DISABLE", "2"}}));
  EXPECT_EQ(d.variables, (Names{"NCCL_IB_DISABLE"}));  // an integer: not 0 disables
  d = explain_link(link("NET/Socket", false),
                   env_of({{"NCCL_NET", "socket"}, {"NCCL_P2P_DISABLE", "1"}}));
  EXPECT_EQ(d.variables, (Names{"NCCL_NET"}));  // any case; P2P does not matter between nodes
  d = explain_link(link("NET/Socket", false), env_of({{"NCCL_NET", "IB"}}));
  EXPECT_FALSE(d.healthy);
  EXPECT_TRUE(d.variables.empty());  // no usable IB device: nothing in the environment
  // A network plugin (the SHARP plugin's IBext, say) between nodes is NCCL's own choice.
  d = explain_link(link("NET/IBext", false), env_of({}));
  EXPECT_TRUE(d.healthy);
}

TEST(L05Reading, ExplainInfiniBandWithoutGpuDirect) {
  auto d = explain_link(link("NET/IB", false, false), env_of({{"NCCL_NET_GDR_LEVEL", "LOC"}}));
  EXPECT_FALSE(d.healthy);
  EXPECT_EQ(d.variables, (Names{"NCCL_NET_GDR_LEVEL"}));
  d = explain_link(link("NET/IB", false, false), env_of({{"NCCL_NET_GDR_LEVEL", "0"}}));
  EXPECT_EQ(d.variables, (Names{"NCCL_NET_GDR_LEVEL"}));
  // Nothing set: the topology or the driver (nvidia-peermem) decided, as with SHM in a node.
  d = explain_link(link("NET/IB", false, false), env_of({{"NCCL_NET_GDR_LEVEL", "PHB"}}));
  EXPECT_TRUE(d.healthy);
  EXPECT_TRUE(d.variables.empty());
  EXPECT_FALSE(d.why.empty());
}

TEST(L05Reading, ExplainRejectsWhatCannotBe) {
  EXPECT_THROW(explain_link(link("SHM", false), env_of({})), std::invalid_argument);
  EXPECT_THROW(explain_link(link("COLLNET", true), env_of({})), std::invalid_argument);
}

// --- NCCL_SOCKET_IFNAME ------------------------------------------------------------------------

TEST(L05Reading, PickInterfacesUnsetPrefersIbThenSkipsDockerLoVirbr) {
  EXPECT_EQ(nccl_pick_interfaces(std::nullopt, {"lo", "eth0", "docker0", "ib0", "ib1"}),
            (Names{"ib0", "ib1"}));
  EXPECT_EQ(nccl_pick_interfaces(std::nullopt, {"lo", "docker0", "virbr0", "eth0", "eth1"}),
            (Names{"eth0", "eth1"}));
  // Only the excluded kinds: docker first, then lo, then virbr.
  EXPECT_EQ(nccl_pick_interfaces(std::nullopt, {"lo", "virbr0", "docker0"}), (Names{"docker0"}));
  EXPECT_EQ(nccl_pick_interfaces(std::nullopt, {"virbr0", "lo"}), (Names{"lo"}));
  EXPECT_EQ(nccl_pick_interfaces(std::nullopt, {"virbr0"}), (Names{"virbr0"}));
  EXPECT_EQ(nccl_pick_interfaces(std::nullopt, {}), Names{});
}

TEST(L05Reading, PickInterfacesPrefixesMatchMoreThanOneName) {
  const Names ifs{"lo", "eth0", "eth0.100", "eth1", "enp65s0"};
  EXPECT_EQ(nccl_pick_interfaces("eth0", ifs), (Names{"eth0", "eth0.100"}));
  EXPECT_EQ(nccl_pick_interfaces("eth", ifs), (Names{"eth0", "eth0.100", "eth1"}));
  EXPECT_EQ(nccl_pick_interfaces("en,lo", ifs), (Names{"lo", "enp65s0"}));  // the machine's order
  EXPECT_EQ(nccl_pick_interfaces("ib", ifs), Names{});                      // find or fail
}

TEST(L05Reading, PickInterfacesExactAndExcluded) {
  const Names ifs{"lo", "docker0", "eth0", "eth0.100", "eth1"};
  EXPECT_EQ(nccl_pick_interfaces("=eth0", ifs), (Names{"eth0"}));
  EXPECT_EQ(nccl_pick_interfaces("=eth0,eth1", ifs), (Names{"eth0", "eth1"}));
  EXPECT_EQ(nccl_pick_interfaces("=eth", ifs), Names{});
  EXPECT_EQ(nccl_pick_interfaces("^docker,lo", ifs), (Names{"eth0", "eth0.100", "eth1"}));
  EXPECT_EQ(nccl_pick_interfaces("^eth0", ifs), (Names{"lo", "docker0", "eth1"}));
  EXPECT_EQ(nccl_pick_interfaces("^=eth0", ifs), (Names{"lo", "docker0", "eth0.100", "eth1"}));
}

TEST(L05Reading, PickInterfacesIgnoresAOneCharacterValue) {
  const Names ifs{"lo", "eth0", "ib0"};
  EXPECT_EQ(nccl_pick_interfaces("e", ifs), (Names{"ib0"}));  // as if unset: ib first
  EXPECT_EQ(nccl_pick_interfaces("", ifs), (Names{"ib0"}));
  EXPECT_EQ(nccl_pick_interfaces("e,", ifs), (Names{"eth0"}));  // two characters: a prefix list
}

TEST(L05Reading, SocketIfnameThatMatchesTheVlanToo) {
  const Names ifs{"lo", "eth0", "eth0.100"};
  const auto d = check_socket_ifname(env_of({{"NCCL_SOCKET_IFNAME", "eth0"}}), ifs, "eth0");
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->variables, (Names{"NCCL_SOCKET_IFNAME"}));
  EXPECT_NE(d->why.find("eth0.100"), std::string::npos) << d->why;
  EXPECT_NE(d->why.find("NCCL_SOCKET_IFNAME==eth0"), std::string::npos) << d->why;
  EXPECT_FALSE(check_socket_ifname(env_of({{"NCCL_SOCKET_IFNAME", "=eth0"}}), ifs, "eth0"));
}

TEST(L05Reading, SocketIfnameUnsetIsRightOrWrongByTheMachine) {
  // Unset on {lo, docker0, eth1}: NCCL takes eth1 alone, the cluster's network: nothing to fix.
  EXPECT_FALSE(check_socket_ifname(env_of({}), {"lo", "docker0", "eth1"}, "eth1").has_value());
  // Unset with an IPoIB interface up: NCCL bootstraps on ib0, but the nodes reach each other on
  // eth0.
  const auto d = check_socket_ifname(env_of({}), {"lo", "eth0", "ib0"}, "eth0");
  ASSERT_TRUE(d.has_value());
  EXPECT_NE(d->why.find("ib0"), std::string::npos) << d->why;
  EXPECT_NE(d->why.find("NCCL_SOCKET_IFNAME==eth0"), std::string::npos) << d->why;
}

TEST(L05Reading, SocketIfnameMisspeltSelectsNothing) {
  const auto d =
      check_socket_ifname(env_of({{"NCCL_SOCKET_IFNAME", "eht0"}}), {"lo", "eth0"}, "eth0");
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->variables, (Names{"NCCL_SOCKET_IFNAME"}));
  EXPECT_NE(d->why.find("NCCL_SOCKET_IFNAME==eth0"), std::string::npos) << d->why;
  EXPECT_THROW(check_socket_ifname(env_of({}), {"lo", "eth0"}, "eth9"), std::invalid_argument);
}

TEST(L05Reading, SocketIfnameExcludingTooLittle) {
  // "^docker" leaves lo in: NCCL may carry socket traffic over loopback addresses.
  const auto d =
      check_socket_ifname(env_of({{"NCCL_SOCKET_IFNAME", "^docker"}}), {"lo", "eth0"}, "eth0");
  ASSERT_TRUE(d.has_value());
  EXPECT_NE(d->why.find("lo"), std::string::npos) << d->why;
}

}  // namespace reading_test
}  // namespace dtc::l05
