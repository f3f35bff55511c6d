// Lesson 03: process groups and collectives. The contract: every function the lesson's
// exercise (collectives.cpp) implements, documented here in full.
//
// Three parts, in the order the README teaches them:
//   1. the collectives tour: one small function per collective, each with a closed-form result;
//   2. the rank grid: where each rank sits in a DP x TP x PP layout, and its three subgroups;
//   3. ring collectives from send/recv: reduce-scatter, all-gather, and allreduce = RS + AG.
//
// Every function takes a communicator (`dtc::Comm`, see dtc/compat.h) and is called by every
// rank of it, SPMD style: the same code on each rank, different data. The tests run the ranks as
// threads (dtc::run_ranks); the program runs them as processes under torchrun.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "dtc/compat.h"
#include "dtc/dist.h"

namespace dtc::l03 {

// =============================================================================================
// Part 1: the collectives tour
// =============================================================================================
// Every function below is a collective: every rank of @p comm calls it, with the same
// arguments. Inputs are fixed by the contract so that each result has a closed form; W is
// comm.getSize(), r is comm.getRank(). All tensors are float32 on the CPU.

/// @brief broadcast: rank r starts with full({n}, r + 1); after the call every rank holds the
///   root's tensor.
/// @param comm the communicator
/// @param root the rank whose tensor is copied to all (0 <= root < W)
/// @param n elements per tensor
/// @return full({n}, root + 1) on every rank
at::Tensor tour_broadcast(Comm& comm, int root, int64_t n);

/// @brief allreduce (SUM): rank r contributes full({n}, r + 1); every rank gets the sum.
/// @return full({n}, W (W + 1) / 2) on every rank
at::Tensor tour_allreduce(Comm& comm, int64_t n);

/// @brief allgather: rank r contributes full({n}, r); every rank gets every contribution.
/// @return a (W, n) tensor whose row i is full({n}, i), on every rank
at::Tensor tour_allgather(Comm& comm, int64_t n);

/// @brief reduce (SUM) to one rank: rank r contributes full({n}, r + 1); only @p root is
///   promised the sum (the other ranks' buffers are scratch afterwards).
/// @param root the rank that receives the sum
/// @return on root: full({n}, W (W + 1) / 2); on the other ranks: an undefined tensor
///   (at::Tensor(), `.defined()` is false)
at::Tensor tour_reduce(Comm& comm, int root, int64_t n);

/// @brief all-to-all (alltoall_base, equal splits): rank r's input is W chunks of @p chunk
///   elements, chunk j filled with 100 r + j (the value says "from r, for j"). Chunk j goes to
///   rank j: every rank sends a different chunk to every other rank.
/// @param chunk elements per chunk (>= 1)
/// @return a (W * chunk) tensor on rank r whose chunk j is full({chunk}, 100 j + r)
at::Tensor tour_alltoall(Comm& comm, int64_t chunk);

/// @brief send/recv around a ring: rank r sends full({n}, r) to rank (r + 1) % W and receives
///   from rank (r - 1 + W) % W. Both are posted before either is waited on, so no rank blocks
///   another (W >= 2).
/// @return full({n}, (r - 1 + W) % W)
at::Tensor tour_send_recv(Comm& comm, int64_t n);

/// @brief barrier: each rank writes the store key "<prefix>arrived/<r>", waits at a barrier,
///   then counts how many of the W keys "<prefix>arrived/0" .. "<prefix>arrived/<W-1>" exist
///   (Store::check). Without the barrier a fast rank could count before a slow one has written.
/// @param store the store that all ranks of @p comm share
/// @param prefix makes the keys unique to this call, e.g. "tour/"
/// @return W on every rank
int tour_barrier(Comm& comm, c10d::Store& store, const std::string& prefix);

// =============================================================================================
// Part 2: the rank grid (DP x TP x PP) and its subgroups
// =============================================================================================
// The course lays ranks out in Megatron-LM's order: TP fastest, then DP, then PP slowest,
//   rank = tp + TP * (dp + DP * pp)
// so a TP group is TP consecutive ranks (one node: TP's per-layer allreduces ride NVLink), a DP
// group strides by TP, and a PP group strides by TP * DP (pipeline stages exchange only
// activations, point to point: they can cross nodes). Megatron-LM's own example
// (megatron/core/parallel_state.py, initialize_model_parallel): 16 GPUs, TP 2, PP 4 ->
// TP groups [0,1] [2,3] ..., DP groups [0,2] [1,3] [4,6] ..., PP groups [0,4,8,12] [1,5,9,13] ...

/// The degrees of a 3D layout. Build one with make_grid(), which checks it.
struct RankGrid {
  int world = 1;  ///< total ranks = dp * tp * pp
  int dp = 1;     ///< data-parallel degree: model replicas
  int tp = 1;     ///< tensor-parallel degree: each layer's matrices split this many ways
  int pp = 1;     ///< pipeline-parallel degree: the layers split into this many stages
};

/// Where one rank sits in the grid: each coordinate counts from 0.
struct GridCoord {
  int dp = 0;  ///< which replica, 0 .. dp-1
  int tp = 0;  ///< which shard of each layer, 0 .. tp-1
  int pp = 0;  ///< which pipeline stage, 0 .. pp-1
  bool operator==(const GridCoord& o) const { return dp == o.dp && tp == o.tp && pp == o.pp; }
};

/// The three axes of the grid.
enum class Axis { kDp, kTp, kPp };

/// "dp", "tp" or "pp".
const char* axis_name(Axis axis);

/// @brief Checks and builds a grid (given in full).
/// @throws UsageError when a degree is below 1 or dp * tp * pp != world; the hint says which
///   degrees would fit.
RankGrid make_grid(int world, int dp, int tp, int pp);

/// @brief The coordinates of @p rank: the inverse of grid_rank().
/// @param rank 0 <= rank < grid.world
/// @return the coordinates c with grid_rank(grid, c) == rank, each within its degree
/// @throws std::out_of_range when rank is outside the grid
GridCoord grid_coords(const RankGrid& grid, int rank);

/// @brief The rank at @p coord: tp + TP * (dp + DP * pp).
/// @throws std::out_of_range when a coordinate is outside its degree
int grid_rank(const RankGrid& grid, const GridCoord& coord);

/// @brief The members of @p rank's group along @p axis: the ranks whose other two coordinates
///   equal @p rank's, in increasing order (so the group's own rank of a member is its index).
/// @return grid.tp, grid.dp or grid.pp ranks, sorted; @p rank is one of them
/// @throws std::out_of_range when rank is outside the grid
std::vector<int> group_ranks(const RankGrid& grid, int rank, Axis axis);

/// @brief Every group along @p axis, each sorted, ordered by its smallest member.
/// @return world / degree groups of `degree` ranks; together they cover every rank once
std::vector<std::vector<int>> all_groups(const RankGrid& grid, Axis axis);

/// One rank's three subgroups.
struct GridGroups {
  GridCoord coord;
  c10::intrusive_ptr<Comm> dp;  ///< this rank's data-parallel group (gradient allreduce)
  c10::intrusive_ptr<Comm> tp;  ///< its tensor-parallel group (per-layer allreduce)
  c10::intrusive_ptr<Comm> pp;  ///< its pipeline group (send/recv between stages)
};

/// @brief Builds @p rank's DP, TP and PP subgroups with dtc::new_subgroup (gloo), each named
///   "<axis>/<members joined by '-'>" (e.g. "tp/2-3") so that every member of a group, and only
///   they, meet under the same store prefix.
/// @param store the store shared by all ranks of the job
/// @param grid the layout; every rank of the job calls this with the same grid
/// @param rank this rank's global rank
/// @param timeout for the subgroups' collectives
/// @return the coordinates of @p rank and its three communicators, each of the size of its
///   axis's degree, in which this rank's rank is its coordinate along that axis
GridGroups build_grid_groups(const c10::intrusive_ptr<c10d::Store>& store, const RankGrid& grid,
                             int rank, std::chrono::milliseconds timeout);

// =============================================================================================
// Part 3: ring collectives from send/recv
// =============================================================================================
// A flat tensor of n elements is cut into W chunks, numpy.array_split style: the first n % W
// chunks hold n / W + 1 elements, the rest n / W (n < W leaves some chunks empty). Rank r owns
// chunk r. All functions work in place on a 1-D, contiguous float32 tensor that has the same
// length on every rank.

/// @brief a mod w in 0 .. w-1, also for negative a: the ring's "rank - s - 1" wraps around.
///   (C++'s % keeps the sign of a: -1 % 4 is -1, not 3.)
inline int ring_mod(int a, int w) { return ((a % w) + w) % w; }

/// A chunk of a flat tensor: elements [offset, offset + size).
struct Chunk {
  int64_t offset = 0;
  int64_t size = 0;
  bool operator==(const Chunk& o) const { return offset == o.offset && size == o.size; }
};

/// @brief Cuts @p n elements into @p world chunks (numpy.array_split's rule).
/// @param n elements, >= 0
/// @param world chunks, >= 1
/// @return world chunks, back to back from offset 0; sizes differ by at most one, larger first
/// @throws std::invalid_argument for n < 0 or world < 1
std::vector<Chunk> ring_chunks(int64_t n, int world);

/// @brief Ring reduce-scatter (SUM), in place. W - 1 steps; at each step rank r sends one chunk
///   to rank r + 1 (and to no other rank) and receives one from rank r - 1, adding it into its own
///   copy. Each step moves n / W elements per rank, whatever W is; chunk r ends complete on rank
///   r (which chunk to send at step s: README section 7's hints).
/// @param comm the communicator (any W >= 1)
/// @param flat 1-D contiguous float32, the same length on every rank
/// @return a view of chunk r of @p flat, which now holds the sum of every rank's chunk r; the
///   other chunks of @p flat hold partial sums (scratch)
/// @throws std::invalid_argument for a tensor that is not 1-D, contiguous float32
at::Tensor ring_reduce_scatter(Comm& comm, const at::Tensor& flat);

/// @brief Ring all-gather, in place: rank r contributes chunk r of @p flat; afterwards every
///   rank's @p flat holds every rank's chunk. W - 1 steps; at each step rank r sends one complete
///   chunk to rank r + 1 and receives one from rank r - 1, straight into its place.
/// @param flat 1-D contiguous float32, the same length on every rank; only chunk r is read
/// @throws std::invalid_argument for a tensor that is not 1-D, contiguous float32
void ring_all_gather(Comm& comm, const at::Tensor& flat);

/// @brief Ring allreduce (SUM), in place: ring_reduce_scatter then ring_all_gather. Each rank
///   sends 2 (W - 1) / W n elements in all: the "bus bandwidth" factor of nccl-tests.
/// @throws std::invalid_argument for a tensor that is not 1-D, contiguous float32
void ring_allreduce(Comm& comm, const at::Tensor& flat);

}  // namespace dtc::l03
