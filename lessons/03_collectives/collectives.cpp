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
  // TODO(L03)
  DTC_TODO("L03",
           "rank r offers full({n}, r + 1); every rank returns root's tensor, "
           "full({n}, root + 1) (L03Tour.Broadcast; the calls: README \"The calls you need\")");
}

at::Tensor tour_allreduce(Comm& comm, int64_t n) {
  // TODO(L03)
  DTC_TODO("L03",
           "rank r contributes full({n}, r + 1); every rank returns the elementwise sum, "
           "full({n}, W (W + 1) / 2) (L03Tour.Allreduce)");
}

at::Tensor tour_allgather(Comm& comm, int64_t n) {
  // TODO(L03)
  DTC_TODO("L03",
           "rank r contributes full({n}, r); every rank returns a (W, n) tensor whose "
           "row i is rank i's contribution (L03Tour.Allgather)");
}

at::Tensor tour_reduce(Comm& comm, int root, int64_t n) {
  // TODO(L03)
  DTC_TODO("L03",
           "rank r contributes full({n}, r + 1); root returns the sum, "
           "full({n}, W (W + 1) / 2), every other rank at::Tensor() (L03Tour.Reduce)");
}

at::Tensor tour_alltoall(Comm& comm, int64_t chunk) {
  // TODO(L03)
  DTC_TODO("L03",
           "rank r's (W * chunk) input holds 100 r + j in chunk j, meant for rank j; "
           "return what arrives: chunk j from rank j, 100 j + r (L03Tour.Alltoall)");
}

at::Tensor tour_send_recv(Comm& comm, int64_t n) {
  // TODO(L03)
  DTC_TODO("L03",
           "rank r passes full({n}, r) to its right neighbour and returns what its left "
           "one passed, full({n}, (r - 1) mod W); no rank may block another "
           "(L03Tour.SendRecvRing)");
}

int tour_barrier(Comm& comm, c10d::Store& store, const std::string& prefix) {
  // TODO(L03)
  DTC_TODO("L03",
           "each rank writes \"<prefix>arrived/<r>\", then, past a barrier, counts the W "
           "keys: every rank must count W, also when one arrives late and over a TCPStore "
           "(L03Tour.Barrier; hints: README section 5)");
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
  // TODO(L03)
  DTC_TODO("L03",
           "rank's coordinates in Megatron order (tp varies fastest, pp slowest), so "
           "that grid_rank(grid, result) == rank (L03Grid.*; hints: README section 6)");
}

int grid_rank(const RankGrid& grid, const GridCoord& coord) {
  if (coord.dp < 0 || coord.dp >= grid.dp || coord.tp < 0 || coord.tp >= grid.tp || coord.pp < 0 ||
      coord.pp >= grid.pp) {
    throw std::out_of_range(
        fmt::format("coordinate (dp {}, tp {}, pp {}) is outside the grid "
                    "dp {} x tp {} x pp {}",
                    coord.dp, coord.tp, coord.pp, grid.dp, grid.tp, grid.pp));
  }
  // TODO(L03)
  DTC_TODO("L03",
           "the inverse of grid_coords: the rank at coord, tp fastest, pp slowest "
           "(L03Grid.*; hints: README section 6)");
}

std::vector<int> group_ranks(const RankGrid& grid, int rank, Axis axis) {
  // TODO(L03)
  DTC_TODO("L03",
           "the ranks that share rank's two other coordinates, ascending: one per value "
           "of axis's coordinate, rank among them (L03Grid.*; hints: README section 6)");
}

std::vector<std::vector<int>> all_groups(const RankGrid& grid, Axis axis) {
  // TODO(L03)
  DTC_TODO("L03",
           "every group along axis once, each sorted, ordered by its smallest member; "
           "together they hold every rank exactly once (L03Grid.*; hints: README section 6)");
}

GridGroups build_grid_groups(const c10::intrusive_ptr<c10d::Store>& store, const RankGrid& grid,
                             int rank, std::chrono::milliseconds timeout) {
  GridGroups g;
  g.coord = grid_coords(grid, rank);
  // TODO(L03)
  DTC_TODO("L03",
           "g.dp, g.tp, g.pp: a gloo subgroup each (dtc::new_subgroup) over rank's group "
           "on that axis, named so that all its members, and no other group, use the same name "
           "(L03GridGroups.*; hints: README section 6)");
  return g;
}

// =============================================================================================
// Part 3: ring collectives from send/recv
// =============================================================================================

std::vector<Chunk> ring_chunks(int64_t n, int world) {
  if (n < 0 || world < 1) {
    throw std::invalid_argument(fmt::format("ring_chunks: n = {}, world = {}", n, world));
  }
  // TODO(L03)
  DTC_TODO("L03",
           "W chunks back to back from offset 0 with numpy.array_split's sizes: they sum "
           "to n, differ by at most one, larger first (L03Ring.ChunksFollowArraySplit; README "
           "section 7)");
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
  // TODO(L03)
  DTC_TODO("L03",
           "in W - 1 steps that send only to r + 1 and receive only from r - 1, make "
           "chunk r of flat the sum of every rank's chunk r and return a view of it; an empty "
           "chunk is "
           "never a message (L03Ring.*; hints: README section 7)");
}

void ring_all_gather(Comm& comm, const at::Tensor& flat) {
  check_flat(flat, "ring_all_gather");
  const std::vector<Chunk> chunks = ring_chunks(flat.numel(), comm.getSize());  // chunk i: rank i's
  // TODO(L03)
  DTC_TODO("L03",
           "in W - 1 steps (send only to r + 1, receive only from r - 1), every chunk i "
           "of flat comes to hold rank i's chunk i; at the start only chunk r is read; an empty "
           "chunk "
           "is never a message (L03Ring.*; hints: README section 7)");
}

void ring_allreduce(Comm& comm, const at::Tensor& flat) {
  check_flat(flat, "ring_allreduce");
  // TODO(L03)
  DTC_TODO("L03",
           "flat becomes, on every rank, the elementwise sum over the ranks, from the "
           "two ring functions above (L03Ring.Allreduce*; hints: README section 7)");
}

}  // namespace dtc::l03
// generated from solutions/03_collectives/collectives.cpp; checksum 0603813ace82d20d
