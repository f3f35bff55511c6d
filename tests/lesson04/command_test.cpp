// Lesson 04 tests: the launch commands of a multi-node job (torchrun_command). The commands are
// read back as a shell and torchrun would read them: split into words by the shell's quoting
// rules, then torchrun's options (--name=value or --name value; dashes and underscores alike)
// up to the program. The end-to-end test `lesson04.*.e2e.multinode_*` goes further: it parses
// them with torchrun's own argument parser and runs them, one torchrun per node.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "dtc/errors.h"
#include "launch_env.h"
#include "usage_error.h"

namespace dtc::l04 {
namespace {

// The words a POSIX shell makes of @p line: blanks separate words; '...' quotes everything,
// "..." everything but \" and \\, a backslash outside quotes the next character. No
// expansions (the course's commands need none).
std::vector<std::string> shell_words(const std::string& line) {
  std::vector<std::string> words;
  std::string word;
  bool in_word = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (c == ' ' || c == '\t' || c == '\n') {
      if (in_word) words.push_back(word);
      word.clear();
      in_word = false;
    } else if (c == '\'') {
      in_word = true;
      const size_t end = line.find('\'', i + 1);
      if (end == std::string::npos) throw std::runtime_error("unclosed ' in: " + line);
      word += line.substr(i + 1, end - i - 1);
      i = end;
    } else if (c == '"') {
      in_word = true;
      for (++i; i < line.size() && line[i] != '"'; ++i) {
        if (line[i] == '\\' && i + 1 < line.size() &&
            std::string("\"\\$`").find(line[i + 1]) != std::string::npos) {
          ++i;
        } else if (line[i] == '$' || line[i] == '`') {
          throw std::runtime_error("a shell would expand the " + std::string(1, line[i]) +
                                   " inside \"...\" of: " + line);
        }
        word += line[i];
      }
      if (i >= line.size()) throw std::runtime_error("unclosed \" in: " + line);
    } else if (c == '\\' && i + 1 < line.size()) {
      in_word = true;
      word += line[++i];
    } else if (std::string("$`;&|<>()*?[]{}~#!").find(c) != std::string::npos) {
      throw std::runtime_error(std::string("a shell would treat the unquoted ") + c +
                               " specially in: " + line);
    } else {
      in_word = true;
      word += c;
    }
  }
  if (in_word) words.push_back(word);
  return words;
}

// A torchrun command line as torchrun's parser sees it.
struct Torchrun {
  std::map<std::string, std::string> options;  // name with '_' for '-' -> value ("" for a flag)
  std::vector<std::string> program;            // the first word that is no option, and the rest
};

// torchrun's options that take no value (torch/distributed/run.py).
const std::set<std::string> kTorchrunFlagsWithoutValue = {
    "standalone", "no_python", "module", "run_path", "m", "virtual_local_rank"};

// Reads @p command, which must start with the words of @p torchrun.
Torchrun read_torchrun(const std::string& command, const std::string& torchrun) {
  const auto words = shell_words(command);
  const auto prefix = shell_words(torchrun);
  EXPECT_GE(words.size(), prefix.size()) << command;
  for (size_t i = 0; i < prefix.size() && i < words.size(); ++i) {
    EXPECT_EQ(words[i], prefix[i])
        << "the command must start with '" << torchrun << "': " << command;
  }
  Torchrun t;
  size_t i = prefix.size();
  for (; i < words.size() && words[i].rfind("-", 0) == 0; ++i) {
    if (words[i] == "--") {  // the end of torchrun's options: the program follows
      ++i;
      break;
    }
    std::string name = words[i].substr(words[i].rfind("--", 0) == 0 ? 2 : 1);
    const std::string spelled = name.substr(0, name.find('='));
    EXPECT_EQ(spelled.find('-'), std::string::npos)
        << "--" << spelled << ": torchrun 1.13 reads only the underscore spelling: " << command;
    std::string value;
    const size_t eq = name.find('=');
    const bool has_value = eq != std::string::npos;
    if (has_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    for (char& c : name) c = c == '-' ? '_' : c;
    if (!has_value && kTorchrunFlagsWithoutValue.count(name) == 0) {
      EXPECT_LT(i + 1, words.size()) << "--" << name << " has no value: " << command;
      if (i + 1 < words.size()) value = words[++i];
    }
    EXPECT_EQ(t.options.count(name), 0u) << "--" << name << " given twice: " << command;
    t.options[name] = value;
  }
  t.program.assign(words.begin() + static_cast<std::ptrdiff_t>(i), words.end());
  return t;
}

MultiNodeJob three_nodes(Rendezvous rendezvous) {
  MultiNodeJob job;
  job.hosts = {"10.0.0.1", "10.0.0.2", "10.0.0.3"};
  job.nproc_per_node = 8;
  job.port = 29500;
  job.job_id = "job42";
  job.rendezvous = rendezvous;
  job.program = {"build/bin/lesson06", "--steps", "20"};
  return job;
}

std::string option(const Torchrun& t, const std::string& name) {
  auto it = t.options.find(name);
  return it == t.options.end() ? "(not given)" : it->second;
}

// --nnodes as torchrun reads it: "N" or "MIN:MAX"; the fixed count N, or "(elastic)".
std::string node_count(const Torchrun& t) {
  const std::string v = option(t, "nnodes");
  const size_t colon = v.find(':');
  if (colon == std::string::npos) return v;
  return v.substr(0, colon) == v.substr(colon + 1) ? v.substr(0, colon) : "(elastic) " + v;
}

// Where static rendezvous finds node 0's store: --rdzv_endpoint, else --master_addr and
// --master_port with torchrun's defaults (127.0.0.1, 29500).
std::string static_endpoint(const Torchrun& t) {
  if (t.options.count("rdzv_endpoint")) return option(t, "rdzv_endpoint");
  const std::string addr = t.options.count("master_addr") ? option(t, "master_addr") : "127.0.0.1";
  const std::string port = t.options.count("master_port") ? option(t, "master_port") : "29500";
  return addr + ":" + port;
}

TEST(L04Command, StaticNumbersEachNodeAndPointsAllAtTheFirst) {
  const MultiNodeJob job = three_nodes(Rendezvous::kStatic);
  std::vector<Torchrun> nodes;
  for (int node = 0; node < 3; ++node) {
    SCOPED_TRACE("node " + std::to_string(node));
    const std::string command = torchrun_command(job, node);
    const Torchrun t = read_torchrun(command, job.torchrun);
    EXPECT_EQ(node_count(t), "3") << command;
    EXPECT_EQ(option(t, "nproc_per_node"), "8") << command;
    EXPECT_EQ(option(t, "node_rank"), std::to_string(node)) << command;
    EXPECT_EQ(static_endpoint(t), "10.0.0.1:29500") << "node 0's store: " << command;
    EXPECT_TRUE(t.options.count("no_python")) << "ranks run the program itself: " << command;
    EXPECT_EQ(t.options.count("standalone"), 0u) << "--standalone means one node: " << command;
    const std::string backend = option(t, "rdzv_backend");
    EXPECT_TRUE(backend == "(not given)" || backend == "static") << command;
    EXPECT_EQ(t.program, job.program) << command;
    nodes.push_back(t);
  }
  // Node 1's command is node 0's with its own number: nothing else differs.
  for (int node = 1; node < 3; ++node) {
    auto a = nodes[0].options, b = nodes[static_cast<size_t>(node)].options;
    a.erase("node_rank");
    b.erase("node_rank");
    EXPECT_EQ(a, b) << "node " << node << "'s command differs from node 0's beyond --node_rank";
  }
}

TEST(L04Command, C10dIsOneCommandForEveryNode) {
  MultiNodeJob job = three_nodes(Rendezvous::kC10d);
  job.hosts = {"node0", "node1"};
  job.port = 29400;
  const std::string command = torchrun_command(job, 0);
  EXPECT_EQ(torchrun_command(job, 1), command) << "c10d: every node types the same command";
  const Torchrun t = read_torchrun(command, job.torchrun);
  EXPECT_EQ(node_count(t), "2") << command;
  EXPECT_EQ(option(t, "nproc_per_node"), "8") << command;
  EXPECT_EQ(t.options.count("standalone"), 0u) << "--standalone means one node: " << command;
  EXPECT_EQ(option(t, "rdzv_backend"), "c10d") << command;
  EXPECT_EQ(option(t, "rdzv_endpoint"), "node0:29400") << command;
  EXPECT_EQ(option(t, "rdzv_id"), "job42") << command;
  EXPECT_EQ(t.options.count("node_rank"), 0u) << "c10d numbers the nodes itself: " << command;
  EXPECT_TRUE(t.options.count("no_python")) << command;
  EXPECT_EQ(t.program, job.program) << command;
}

TEST(L04Command, ArgumentsArriveUnchangedThroughTheShell) {
  MultiNodeJob job = three_nodes(Rendezvous::kStatic);
  job.torchrun = "/opt/venv/bin/torchrun --redirects 2 --tee 2";
  job.program = {"./my program", "--name", "it's", "a\"b", "$HOME", "`id`", "",
                 "semi;colon",   "*",      "a\\b", "~",    "#x"};
  for (int node : {0, 2}) {
    const std::string command = torchrun_command(job, node);
    EXPECT_EQ(command.rfind(job.torchrun + " ", 0), 0u)
        << "starts with the given torchrun: " << command;
    const Torchrun t = read_torchrun(command, job.torchrun);
    EXPECT_EQ(t.program, job.program) << command;
    EXPECT_EQ(node_count(t), "3") << "torchrun's own flags first, then the job's: " << command;
  }
}

TEST(L04Command, BadJobsAreUsageErrors) {
  const MultiNodeJob good = three_nodes(Rendezvous::kStatic);
  auto with = [&](const std::function<void(MultiNodeJob&)>& change) {
    MultiNodeJob j = good;
    change(j);
    return j;
  };
  expect_usage([&] { torchrun_command(with([](MultiNodeJob& j) { j.hosts.clear(); }), 0); },
               "--hosts");
  expect_usage([&] { torchrun_command(with([](MultiNodeJob& j) { j.nproc_per_node = 0; }), 0); },
               "--nproc-per-node");
  expect_usage([&] { torchrun_command(with([](MultiNodeJob& j) { j.port = 0; }), 0); }, "--port");
  expect_usage([&] { torchrun_command(with([](MultiNodeJob& j) { j.port = 65536; }), 0); },
               "--port");
  expect_usage([&] { torchrun_command(good, 3); }, "--node");
  expect_usage([&] { torchrun_command(good, -1); }, "--node");
  expect_usage(
      [&] {
        torchrun_command(with([](MultiNodeJob& j) {
                           j.rendezvous = Rendezvous::kC10d;
                           j.job_id.clear();
                         }),
                         0);
      },
      "--job-id");
  expect_usage([&] { torchrun_command(with([](MultiNodeJob& j) { j.program.clear(); }), 0); },
               "program");
}

}  // namespace
}  // namespace dtc::l04
