// dtc::Mesh: the ranks of a job as an N-D grid of named parallel dimensions, and the
// communicators of its groups, built once per job.
//
// One order for every lesson, torchtitan's (ParallelDims, torchtitan/distributed/parallel_dims.py):
//
//   pp, dp_replicate, dp_shard, cp, tp        slowest to fastest
//
// rank = tp_rank + tp (cp_rank + cp (dp_shard_rank + dp_shard (dp_replicate_rank + dp_replicate
// pp_rank))): a TP group is tp consecutive ranks (one node's NVLink domain when tp divides the GPUs
// per node), CP strides by tp, and so on out to PP, whose stages are the farthest apart. Llama 3
// (sec. 3.3.2) orders its 4-D parallelism [TP, CP, PP, DP], fastest first: the same but for DP,
// which it puts outside PP. The course keeps torchtitan's.
//
// Lesson 03's RankGrid is the exercise that teaches the idea (three named dimensions); this is
// its general form, given from lesson 07 on. Expert parallelism (lesson 13) never multiplies the
// world size: torchtitan borrows its ranks from the others, splitting dp_shard into dp_shard_mod_ep
// x dp_shard_in_ep and taking ep = dp_shard_in_ep x cp (x tp as well when the experts are not
// tensor-parallel). Where ep = dp_shard x cp that is the flattened group
// group(rank, {"dp_shard", "cp"}); an ep that takes only part of dp_shard needs that split, which
// this mesh does not make yet.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "dtc/dist.h"

namespace dtc {

/// One dimension as a program's flags give it: its name (one of Mesh::kOrder), its degree (0:
/// infer it from the world size) and the flag that set it, which errors name ("--tp").
struct MeshDim {
  std::string name;
  int degree = 1;
  std::string flag;
};

/// The ranks of a job as a grid of named dimensions (see the file's comment for the order).
/// Dimensions a program does not use have degree 1. Pure arithmetic: no communicator.
class Mesh {
 public:
  /// Every dimension's name, slowest first.
  static const std::vector<std::string>& order();

  /// @brief The mesh of @p world ranks over @p dims (any subset of order(), in any order).
  /// @throws UsageError naming the dimension's flag when a degree is negative, a name is unknown
  ///   or repeated, more than one degree is 0, or the degrees' product is not @p world (the
  ///   message says how many ranks the degrees need and the hint how to launch them).
  static Mesh build(int world, const std::vector<MeshDim>& dims);

  int world() const { return world_; }
  /// The degree of @p dim (1 for a dimension the job does not use).
  /// @throws std::invalid_argument for a name that is not in order().
  int size(const std::string& dim) const;
  /// The product of the degrees of @p dims. Here and below, a set of dimensions with a name that
  /// is not in order(), or with a name twice, throws std::invalid_argument, and a rank outside
  /// [0, world()) std::out_of_range.
  int size(const std::vector<std::string>& dims) const;
  /// @p rank's coordinate along @p dim, in [0, size(dim)).
  int coord(int rank, const std::string& dim) const;
  /// @p rank's index in its group over @p dims (the flattened coordinate, slowest dim first):
  /// its rank in the communicator group_comm would give it.
  int coord(int rank, const std::vector<std::string>& dims) const;
  /// The rank at @p coords; dimensions left out are 0.
  /// @throws std::out_of_range for a coordinate outside [0, size(dim))
  int rank_of(const std::map<std::string, int>& coords) const;
  /// @brief The ranks that share every coordinate with @p rank except those along @p dims, in
  ///   ascending order (which is also the order of their flattened coordinate). {} -> {rank};
  ///   every dimension -> the world.
  std::vector<int> group(int rank, const std::vector<std::string>& dims) const;
  /// The group's one name (the store-prefix rule of every course communicator): the dimensions
  /// joined by '+', then '/', then the members joined by '-': "dp_shard+cp/1-3-5-7".
  std::string group_name(int rank, const std::vector<std::string>& dims) const;
  /// "dp_shard 2 x cp 2 x tp 2 (8 ranks)": the dimensions of degree above 1, slowest first.
  std::string describe() const;
  /// @brief @p dims in the mesh's order, joined by '+' ("dp_shard+cp"; "self" for none).
  /// @throws std::invalid_argument for an unknown or repeated name
  static std::string key(const std::vector<std::string>& dims);

 private:
  int world_ = 1;
  std::vector<int> sizes_;    // per order() entry
  std::vector<int> strides_;  // per order() entry: rank stride of one step along it
  static size_t index(const std::string& dim);
  void check_rank(int rank) const;
};

/// One rank's communicators over a Mesh: one per requested set of dimensions, each built once
/// with dtc::new_subgroup and Mesh::group_name. Every rank builds its sets in the same order
/// (the constructor's), which NCCL needs: a rank that belongs to several groups must not create
/// them in an order another member does not.
class MeshGroups {
 public:
  MeshGroups() = default;
  /// @brief Builds @p rank's groups over @p sets (for example {{"tp"}, {"cp"}, {"dp_shard",
  ///   "cp"}}), in that order. A set whose group is {rank} alone is still a communicator of one.
  MeshGroups(const c10::intrusive_ptr<c10d::Store>& store, const Mesh& mesh, int rank,
             const std::vector<std::vector<std::string>>& sets, BackendKind backend,
             std::chrono::milliseconds timeout, const std::string& master_addr = "127.0.0.1");

  /// The communicator over @p dims (a set given to the constructor, in any order).
  /// @throws std::out_of_range naming the set when it was not built.
  const c10::intrusive_ptr<Comm>& get(const std::vector<std::string>& dims) const;
  const Mesh& mesh() const { return mesh_; }
  int rank() const { return rank_; }

 private:
  Mesh mesh_;
  int rank_ = 0;
  std::map<std::string, c10::intrusive_ptr<Comm>> comms_;  // by the set's canonical key
};

}  // namespace dtc
