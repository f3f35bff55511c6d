// Lesson 04, given in full: reading one environment variable at a time, with clear errors, and
// the table of every variable a launcher sets (what the program's --show-env prints).
//
// Your code in launch_env.cpp builds on these helpers; tests/lesson04/env_vars_test.cpp checks
// them (suite L04EnvVarsGiven: it passes before you start).
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dtc/launch.h"

namespace dtc::l04 {

/// A fake environment, for tests and experiments: name -> value.
using EnvMap = std::map<std::string, std::string>;

/// An EnvLookup that reads @p vars (copied), the way dtc::process_env reads the real one.
EnvLookup lookup_in(EnvMap vars);

/// The integer value of variable @p name, or nullopt when it is unset.
/// @throws UsageError(name): "'<value>' is not an integer" for anything but an optional '-'
///   and digits that fit an int (so "", "2x", " 2", "1e3" and "99999999999" are errors).
std::optional<int> env_int(const EnvLookup& env, const std::string& name);

/// The integer value of variable @p name, which must be set.
/// @param why the end of the sentence "<name> is not set, but <why>", e.g. "RANK is set"
/// @throws UsageError(name) when unset (the hint: launch with the launcher, which sets the
///   variables together, or unset the partial set), or as env_int when it does not parse.
int env_required_int(const EnvLookup& env, const std::string& name, const std::string& why);

/// The boolean value of variable @p name: True/true/1 or False/false/0; nullopt when unset.
/// @throws UsageError(name) for any other value.
std::optional<bool> env_bool(const EnvLookup& env, const std::string& name);

/// The four numbers every launcher provides, each with its own variable name.
enum class Var { kRank, kWorldSize, kLocalRank, kLocalWorldSize };

/// The name @p launcher gives to @p var: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE for
/// torchrun and for no launcher; OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE for mpirun.
std::string var_name(Launcher launcher, Var var);

/// @p args joined by spaces, each quoted for a POSIX shell when it needs it ('it''s' style:
/// single quotes, and '\'' for a quote inside), so that the result can be pasted into a shell.
std::string shell_join(const std::vector<std::string>& args);

/// One variable a launcher sets, for the README's table and the program's --show-env.
struct VarDoc {
  std::string name;     ///< e.g. "LOCAL_RANK"
  std::string set_by;   ///< "torchrun", "torchrun (agent)", "mpirun", "you", ...
  std::string meaning;  ///< what a program does with it, in one line
};

/// Every variable lesson 04 teaches, torchrun's first (in the order of the README's table),
/// then OpenMPI's, then the ones you set yourself (GLOO_SOCKET_IFNAME, ...).
const std::vector<VarDoc>& launch_variables();

}  // namespace dtc::l04
