// Lesson 03: process groups and collectives. Implements lessons/03_collectives/collectives.h.
//
// Fill in every TODO(L03) below, top to bottom; `make test-lesson03` runs each collective on
// 2, 3 and 4 thread-ranks and checks it against its closed form (and your ring allreduce
// against gloo's own). Then run the program on real processes:
//   torchrun --standalone --nproc_per_node=4 --no_python build/bin/lesson03 --tp 2
#include "collectives.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <stdexcept>

#include "dtc/errors.h"
#include "dtc/todo.h"

namespace dtc::l03 {

// =============================================================================================
// Part 1: the collectives tour
// =============================================================================================
// The c10d calls take a std::vector of tensors (one per local device: always one here) and
// return a Work; ->wait() blocks until this rank's part is done (and throws on a timeout).

at::Tensor tour_broadcast(Comm& comm, int root, int64_t n) {
  // TODO(L03): fill full({n}, rank + 1), broadcast it from root (BroadcastOptions
  //   rootRank), wait, return it
  DTC_TODO("L03", "fill full({n}, rank + 1), broadcast it from root (BroadcastOptions "
                  "rootRank), wait, return it");
}

at::Tensor tour_allreduce(Comm& comm, int64_t n) {
  // TODO(L03): fill full({n}, rank + 1), allreduce it (SUM is the default), return it
  DTC_TODO("L03", "fill full({n}, rank + 1), allreduce it (SUM is the default), return it");
}

at::Tensor tour_allgather(Comm& comm, int64_t n) {
  // TODO(L03): allgather full({n}, rank) into W output tensors (a vector of vectors), then
  //   torch::stack them into (W, n)
  DTC_TODO("L03", "allgather full({n}, rank) into W output tensors (a vector of vectors), then "
                  "torch::stack them into (W, n)");
}

at::Tensor tour_reduce(Comm& comm, int root, int64_t n) {
  // TODO(L03): fill full({n}, rank + 1), reduce it to root (ReduceOptions rootRank); return
  //   it on root and at::Tensor() elsewhere
  DTC_TODO("L03", "fill full({n}, rank + 1), reduce it to root (ReduceOptions rootRank); return "
                  "it on root and at::Tensor() elsewhere");
}

at::Tensor tour_alltoall(Comm& comm, int64_t chunk) {
  // TODO(L03): build the (W * chunk) input whose chunk j is 100 r + j, and alltoall_base it
  //   into an output of the same size (empty split-size vectors: equal splits)
  DTC_TODO("L03", "build the (W * chunk) input whose chunk j is 100 r + j, and alltoall_base it "
                  "into an output of the same size (empty split-size vectors: equal splits)");
}

at::Tensor tour_send_recv(Comm& comm, int64_t n) {
  // TODO(L03): post send(full({n}, r)) to (r + 1) % W and recv from (r - 1 + W) % W, then
  //   wait on both (post both first: two ranks that each wait on a send could deadlock)
  DTC_TODO("L03", "post send(full({n}, r)) to (r + 1) % W and recv from (r - 1 + W) % W, then "
                  "wait on both (post both first: two ranks that each wait on a send could deadlock)");
}

int tour_barrier(Comm& comm, c10d::Store& store, const std::string& prefix) {
  // TODO(L03): set "<prefix>arrived/<r>", make sure the store has it (a TCPStore set does
  //   not wait for the server), barrier, then count the W keys with store.check
  DTC_TODO("L03", "set \"<prefix>arrived/<r>\", make sure the store has it (a TCPStore set does "
                  "not wait for the server), barrier, then count the W keys with store.check");
}

// =============================================================================================
// Part 2: the rank grid
// =============================================================================================

const char* axis_name(Axis axis) {
  switch (axis) {
    case Axis::kDp: return "dp";
    case Axis::kTp: return "tp";
    case Axis::kPp: return "pp";
  }
  return "?";
}

RankGrid make_grid(int world, int dp, int tp, int pp) {
  for (auto [flag, value] : {std::pair<const char*, int>{"--dp", dp}, {"--tp", tp}, {"--pp", pp}}) {
    if (value < 1) {
      throw UsageError(flag, fmt::format("degree {} is below 1", value),
                       fmt::format("every degree is at least 1, e.g. {} 1", flag));
    }
  }
  if (world < 1 || dp * tp * pp != world) {
    std::string fits;
    for (int d = 1; d <= world; ++d) {
      if (world % d == 0) fits += (fits.empty() ? "" : ", ") + std::to_string(d);
    }
    throw UsageError("--tp/--pp",
                     fmt::format("dp {} x tp {} x pp {} = {}, but there are {} ranks", dp, tp, pp,
                                 dp * tp * pp, world),
                     fmt::format("choose tp and pp that divide the world size {} (its divisors: "
                                 "{}); dp is what is left",
                                 world, fits));
  }
  return RankGrid{world, dp, tp, pp};
}

GridCoord grid_coords(const RankGrid& grid, int rank) {
  if (rank < 0 || rank >= grid.world) {
    throw std::out_of_range(fmt::format("rank {} is outside the grid of {}", rank, grid.world));
  }
  // TODO(L03): tp is the fastest-varying coordinate, pp the slowest:
  //   tp = rank % TP, dp = (rank / TP) % DP, pp = rank / (TP * DP)
  DTC_TODO("L03", "tp is the fastest-varying coordinate, pp the slowest: "
                  "tp = rank % TP, dp = (rank / TP) % DP, pp = rank / (TP * DP)");
}

int grid_rank(const RankGrid& grid, const GridCoord& coord) {
  if (coord.dp < 0 || coord.dp >= grid.dp || coord.tp < 0 || coord.tp >= grid.tp || coord.pp < 0 ||
      coord.pp >= grid.pp) {
    throw std::out_of_range(
        fmt::format("coordinate (dp {}, tp {}, pp {}) is outside the grid "
                    "dp {} x tp {} x pp {}",
                    coord.dp, coord.tp, coord.pp, grid.dp, grid.tp, grid.pp));
  }
  // TODO(L03): return tp + TP * (dp + DP * pp)
  DTC_TODO("L03", "return tp + TP * (dp + DP * pp)");
}

std::vector<int> group_ranks(const RankGrid& grid, int rank, Axis axis) {
  // TODO(L03): take rank's coordinates, vary the one of `axis` over 0 .. degree-1 and map
  //   each back with grid_rank (increasing along any one axis: already sorted)
  DTC_TODO("L03", "take rank's coordinates, vary the one of `axis` over 0 .. degree-1 and map "
                  "each back with grid_rank (increasing along any one axis: already sorted)");
}

std::vector<std::vector<int>> all_groups(const RankGrid& grid, Axis axis) {
  // TODO(L03): walk the ranks in order; each rank not yet in a group starts its group
  //   (group_ranks), so the groups come out ordered by their smallest member
  DTC_TODO("L03", "walk the ranks in order; each rank not yet in a group starts its group "
                  "(group_ranks), so the groups come out ordered by their smallest member");
}

GridGroups build_grid_groups(const c10::intrusive_ptr<c10d::Store>& store, const RankGrid& grid,
                             int rank, std::chrono::milliseconds timeout) {
  GridGroups g;
  g.coord = grid_coords(grid, rank);
  // TODO(L03): for each axis, new_subgroup(store, "<axis>/<members joined by '-'>",
  //   group_ranks(grid, rank, axis), rank, BackendKind::kGloo, timeout)
  DTC_TODO("L03", "for each axis, new_subgroup(store, \"<axis>/<members joined by '-'>\", "
                  "group_ranks(grid, rank, axis), rank, BackendKind::kGloo, timeout)");
  return g;
}

// =============================================================================================
// Part 3: ring collectives from send/recv
// =============================================================================================

std::vector<Chunk> ring_chunks(int64_t n, int world) {
  if (n < 0 || world < 1) {
    throw std::invalid_argument(fmt::format("ring_chunks: n = {}, world = {}", n, world));
  }
  // TODO(L03): chunk i holds n / W elements, plus one more for the first n % W chunks;
  //   offsets run back to back from 0
  DTC_TODO("L03", "chunk i holds n / W elements, plus one more for the first n % W chunks; "
                  "offsets run back to back from 0");
}

namespace {

void check_flat(const at::Tensor& flat, const char* who) {
  if (!flat.defined() || flat.dim() != 1 || !flat.is_contiguous() ||
      flat.scalar_type() != at::kFloat) {
    throw std::invalid_argument(
        fmt::format("{}: needs a 1-D contiguous float32 tensor, got {}", who,
                    flat.defined() ? flat.toString() + " of shape " + c10::str(flat.sizes())
                                   : std::string("an undefined tensor")));
  }
}

// Tags keep the two phases' messages apart (gloo matches a recv to a send by peer and tag).
constexpr int kReduceScatterTag = 1000;
constexpr int kAllGatherTag = 2000;

}  // namespace

at::Tensor ring_reduce_scatter(Comm& comm, const at::Tensor& flat) {
  check_flat(flat, "ring_reduce_scatter");
  const std::vector<Chunk> chunks = ring_chunks(flat.numel(), comm.getSize());  // chunk i: rank i's
  // TODO(L03): W - 1 steps: send chunk (r - s - 1) mod W to r + 1, receive chunk
  //   (r - s - 2) mod W from r - 1 into a scratch buffer, wait on both, add it in. Skip the
  //   messages of empty chunks (both sides know the sizes). Return flat's chunk r.
  DTC_TODO("L03", "W - 1 steps: send chunk (r - s - 1) mod W to r + 1, receive chunk "
                  "(r - s - 2) mod W from r - 1 into a scratch buffer, wait on both, add it in. Skip the "
                  "messages of empty chunks (both sides know the sizes). Return flat's chunk r.");
}

void ring_all_gather(Comm& comm, const at::Tensor& flat) {
  check_flat(flat, "ring_all_gather");
  const std::vector<Chunk> chunks = ring_chunks(flat.numel(), comm.getSize());  // chunk i: rank i's
  // TODO(L03): W - 1 steps: send chunk (r - s) mod W to r + 1, receive chunk
  //   (r - s - 1) mod W from r - 1 straight into flat (a narrow() view is contiguous)
  DTC_TODO("L03", "W - 1 steps: send chunk (r - s) mod W to r + 1, receive chunk "
                  "(r - s - 1) mod W from r - 1 straight into flat (a narrow() view is contiguous)");
}

void ring_allreduce(Comm& comm, const at::Tensor& flat) {
  check_flat(flat, "ring_allreduce");
  // TODO(L03): ring_reduce_scatter, then ring_all_gather, on the same flat tensor
  DTC_TODO("L03", "ring_reduce_scatter, then ring_all_gather, on the same flat tensor");
}

}  // namespace dtc::l03
// exercise generated from solutions/03_collectives/collectives.cpp by scripts/exercises.py; checksum 2902ed3b079fa4ed
