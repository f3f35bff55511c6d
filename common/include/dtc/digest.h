// A digest of a model's parameters, for comparing two programs on their parameters and not
// only on their losses (AdamW's update hardly changes when every gradient is k times too large;
// the parameters do). Every training program (lesson 02 on) prints it in its --json line as
// "param_digest": for each parameter of the full, unsharded model, in the named_parameters()
// order of the single-device baseline (the course's Gpt), {"name", "numel", "sum", "sumsq"},
// after the last step, sums in double.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <utility>
#include <vector>

#include "dtc/compat.h"

namespace dtc {

/// A parameter, or a disjoint piece of one, under the full model's name.
using NamedPiece = std::pair<std::string, torch::Tensor>;

/// The digest of @p names (in that order) from the @p pieces this rank holds. Every element of
/// every parameter must be in exactly one piece over all ranks: whole parameters, or disjoint
/// shards of one (a replicated parameter is passed by one rank only). With @p comm, the pieces
/// of all its ranks are summed (one allreduce: every rank must call it, and all get the digest);
/// without, this rank's pieces must be all of them.
/// @throws std::invalid_argument for a piece whose name is not in @p names
nlohmann::json param_digest(const std::vector<std::string>& names,
                            const std::vector<NamedPiece>& pieces, Comm* comm = nullptr);

/// The same, summed over several communicators in turn (tensor parallelism: over the TP group,
/// then over the DP group, which together span every rank).
nlohmann::json param_digest(const std::vector<std::string>& names,
                            const std::vector<NamedPiece>& pieces, const std::vector<Comm*>& comms);

/// The digest of a whole model on one rank: its own named_parameters(), in their order.
nlohmann::json param_digest(const torch::nn::Module& model);

}  // namespace dtc
