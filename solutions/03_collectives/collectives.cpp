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
  // BEGIN SOLUTION: rank r offers full({n}, r + 1); every rank returns root's tensor,
  //   full({n}, root + 1) (L03Tour.Broadcast; the calls: README "The calls you need")
  std::vector<at::Tensor> t{torch::full({n}, static_cast<float>(comm.getRank() + 1))};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  comm.broadcast(t, opts)->wait();
  return t[0];
  // END SOLUTION
}

at::Tensor tour_allreduce(Comm& comm, int64_t n) {
  // BEGIN SOLUTION: rank r contributes full({n}, r + 1); every rank returns the elementwise sum,
  //   full({n}, W (W + 1) / 2) (L03Tour.Allreduce)
  std::vector<at::Tensor> t{torch::full({n}, static_cast<float>(comm.getRank() + 1))};
  comm.allreduce(t)->wait();  // in place: every rank now holds 1 + 2 + ... + W
  return t[0];
  // END SOLUTION
}

at::Tensor tour_allgather(Comm& comm, int64_t n) {
  // BEGIN SOLUTION: rank r contributes full({n}, r); every rank returns a (W, n) tensor whose
  //   row i is rank i's contribution (L03Tour.Allgather)
  const int world = comm.getSize();
  std::vector<at::Tensor> in{torch::full({n}, static_cast<float>(comm.getRank()))};
  std::vector<std::vector<at::Tensor>> out(1);  // [device][rank]: one device, W outputs
  for (int i = 0; i < world; ++i) out[0].push_back(torch::empty({n}));
  comm.allgather(out, in)->wait();
  return torch::stack(out[0]);  // (W, n): row i came from rank i
  // END SOLUTION
}

at::Tensor tour_reduce(Comm& comm, int root, int64_t n) {
  // BEGIN SOLUTION: rank r contributes full({n}, r + 1); root returns the sum,
  //   full({n}, W (W + 1) / 2), every other rank at::Tensor() (L03Tour.Reduce)
  std::vector<at::Tensor> t{torch::full({n}, static_cast<float>(comm.getRank() + 1))};
  c10d::ReduceOptions opts;
  opts.rootRank = root;
  comm.reduce(t, opts)->wait();                     // gloo has reduce in both LibTorch generations
  if (comm.getRank() != root) return at::Tensor();  // a non-root's buffer is scratch now
  return t[0];
  // END SOLUTION
}

at::Tensor tour_alltoall(Comm& comm, int64_t chunk) {
  // BEGIN SOLUTION: rank r's (W * chunk) input holds 100 r + j in chunk j, meant for rank j;
  //   return what arrives: chunk j from rank j, 100 j + r (L03Tour.Alltoall)
  const int world = comm.getSize();
  const int rank = comm.getRank();
  auto in = torch::empty({world * chunk});
  for (int j = 0; j < world; ++j) in.narrow(0, j * chunk, chunk).fill_(100.0 * rank + j);
  auto out = torch::empty({world * chunk});
  std::vector<int64_t> equal_splits;  // empty: W equal chunks
  comm.alltoall_base(out, in, equal_splits, equal_splits)->wait();
  return out;  // chunk j came from rank j, which built it for us: 100 j + r
  // END SOLUTION
}

at::Tensor tour_send_recv(Comm& comm, int64_t n) {
  // BEGIN SOLUTION: rank r passes full({n}, r) to its right neighbour and returns what its left
  //   one passed, full({n}, (r - 1) mod W); no rank may block another (L03Tour.SendRecvRing)
  const int world = comm.getSize();
  const int rank = comm.getRank();
  std::vector<at::Tensor> out{torch::full({n}, static_cast<float>(rank))};
  std::vector<at::Tensor> in{torch::empty({n})};
  auto send = comm.send(out, (rank + 1) % world, /*tag=*/0);
  auto recv = comm.recv(in, (rank - 1 + world) % world, /*tag=*/0);
  send->wait();
  recv->wait();
  return in[0];
  // END SOLUTION
}

int tour_barrier(Comm& comm, c10d::Store& store, const std::string& prefix) {
  // BEGIN SOLUTION: each rank writes "<prefix>arrived/<r>", then, past a barrier, counts the W
  //   keys: every rank must count W, also when one arrives late and over a TCPStore
  //   (L03Tour.Barrier; hints: README section 5)
  const int world = comm.getSize();
  const std::string mine = fmt::format("{}arrived/{}", prefix, comm.getRank());
  store.set(mine, std::vector<uint8_t>{1});
  store.get(mine);         // a round trip on our connection: the server has applied our set
  comm.barrier()->wait();  // after this, every rank's key is in the store
  int seen = 0;
  for (int i = 0; i < world; ++i) {
    if (store.check({fmt::format("{}arrived/{}", prefix, i)})) ++seen;
  }
  return seen;
  // END SOLUTION
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
  // BEGIN SOLUTION: rank's coordinates in Megatron order (tp varies fastest, pp slowest), so
  //   that grid_rank(grid, result) == rank (L03Grid.*; hints: README section 6)
  GridCoord c;
  c.tp = rank % grid.tp;
  c.dp = (rank / grid.tp) % grid.dp;
  c.pp = rank / (grid.tp * grid.dp);
  return c;
  // END SOLUTION
}

int grid_rank(const RankGrid& grid, const GridCoord& coord) {
  if (coord.dp < 0 || coord.dp >= grid.dp || coord.tp < 0 || coord.tp >= grid.tp || coord.pp < 0 ||
      coord.pp >= grid.pp) {
    throw std::out_of_range(
        fmt::format("coordinate (dp {}, tp {}, pp {}) is outside the grid "
                    "dp {} x tp {} x pp {}",
                    coord.dp, coord.tp, coord.pp, grid.dp, grid.tp, grid.pp));
  }
  // BEGIN SOLUTION: the inverse of grid_coords: the rank at coord, tp fastest, pp slowest
  //   (L03Grid.*; hints: README section 6)
  return coord.tp + grid.tp * (coord.dp + grid.dp * coord.pp);
  // END SOLUTION
}

std::vector<int> group_ranks(const RankGrid& grid, int rank, Axis axis) {
  // BEGIN SOLUTION: the ranks that share rank's two other coordinates, ascending: one per value
  //   of axis's coordinate, rank among them (L03Grid.*; hints: README section 6)
  const GridCoord me = grid_coords(grid, rank);
  const int degree = axis == Axis::kDp ? grid.dp : axis == Axis::kTp ? grid.tp : grid.pp;
  std::vector<int> members;
  for (int i = 0; i < degree; ++i) {
    GridCoord c = me;
    (axis == Axis::kDp ? c.dp : axis == Axis::kTp ? c.tp : c.pp) = i;
    members.push_back(grid_rank(grid, c));
  }
  return members;
  // END SOLUTION
}

std::vector<std::vector<int>> all_groups(const RankGrid& grid, Axis axis) {
  // BEGIN SOLUTION: every group along axis once, each sorted, ordered by its smallest member;
  //   together they hold every rank exactly once (L03Grid.*; hints: README section 6)
  std::vector<std::vector<int>> groups;
  std::vector<char> placed(grid.world, 0);
  for (int r = 0; r < grid.world; ++r) {
    if (placed[r]) continue;
    groups.push_back(group_ranks(grid, r, axis));
    for (int m : groups.back()) placed[m] = 1;
  }
  return groups;
  // END SOLUTION
}

GridGroups build_grid_groups(const c10::intrusive_ptr<c10d::Store>& store, const RankGrid& grid,
                             int rank, std::chrono::milliseconds timeout) {
  GridGroups g;
  g.coord = grid_coords(grid, rank);
  // BEGIN SOLUTION: g.dp, g.tp, g.pp: a gloo subgroup each (dtc::new_subgroup) over rank's group
  //   on that axis, named so that all its members, and no other group, use the same name
  //   (L03GridGroups.*; hints: README section 6)
  for (Axis axis : {Axis::kDp, Axis::kTp, Axis::kPp}) {
    const std::vector<int> members = group_ranks(grid, rank, axis);
    // The name is the group's identity: all its members compute the same one, no other group
    // can (members differ), so they meet under one store prefix and nobody else does.
    const std::string name = fmt::format("{}/{}", axis_name(axis), fmt::join(members, "-"));
    auto comm = new_subgroup(store, name, members, rank, BackendKind::kGloo, timeout);
    (axis == Axis::kDp ? g.dp : axis == Axis::kTp ? g.tp : g.pp) = comm;
  }
  // END SOLUTION
  return g;
}

// =============================================================================================
// Part 3: ring collectives from send/recv
// =============================================================================================

std::vector<Chunk> ring_chunks(int64_t n, int world) {
  if (n < 0 || world < 1) {
    throw std::invalid_argument(fmt::format("ring_chunks: n = {}, world = {}", n, world));
  }
  // BEGIN SOLUTION: W chunks back to back from offset 0 with numpy.array_split's sizes: they sum
  //   to n, differ by at most one, larger first (L03Ring.ChunksFollowArraySplit; README section 7)
  std::vector<Chunk> chunks(world);
  int64_t offset = 0;
  for (int i = 0; i < world; ++i) {
    chunks[i].offset = offset;
    chunks[i].size = n / world + (i < n % world ? 1 : 0);
    offset += chunks[i].size;
  }
  return chunks;
  // END SOLUTION
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
  // BEGIN SOLUTION: in W - 1 steps that send only to r + 1 and receive only from r - 1, make
  //   chunk r of flat the sum of every rank's chunk r and return a view of it; an empty chunk is
  //   never a message (L03Ring.*; hints: README section 7)
  const int world = comm.getSize();
  const int rank = comm.getRank();
  const int next = ring_mod(rank + 1, world);
  const int prev = ring_mod(rank - 1, world);
  for (int s = 0; s < world - 1; ++s) {
    const Chunk out = chunks[ring_mod(rank - s - 1, world)];  // what we pass on: partial sum so far
    const Chunk in = chunks[ring_mod(rank - s - 2, world)];   // what prev passes us for this chunk
    c10::intrusive_ptr<c10d::Work> send, recv;  // gloo: send and recv are both asynchronous
    std::vector<at::Tensor> send_buf{flat.narrow(0, out.offset, out.size)};
    std::vector<at::Tensor> recv_buf{torch::empty({in.size})};
    if (out.size > 0) send = comm.send(send_buf, next, kReduceScatterTag + s);
    if (in.size > 0) recv = comm.recv(recv_buf, prev, kReduceScatterTag + s);
    if (send) send->wait();
    if (recv) {
      recv->wait();
      flat.narrow(0, in.offset, in.size).add_(recv_buf[0]);  // (in.size,) partial sum grows
    }
  }
  // After W - 1 steps the last chunk we added into is (r - (W - 2) - 2) mod W = r: complete.
  return flat.narrow(0, chunks[rank].offset, chunks[rank].size);
  // END SOLUTION
}

void ring_all_gather(Comm& comm, const at::Tensor& flat) {
  check_flat(flat, "ring_all_gather");
  const std::vector<Chunk> chunks = ring_chunks(flat.numel(), comm.getSize());  // chunk i: rank i's
  // BEGIN SOLUTION: in W - 1 steps (send only to r + 1, receive only from r - 1), every chunk i
  //   of flat comes to hold rank i's chunk i; at the start only chunk r is read; an empty chunk
  //   is never a message (L03Ring.*; hints: README section 7)
  const int world = comm.getSize();
  const int rank = comm.getRank();
  const int next = ring_mod(rank + 1, world);
  const int prev = ring_mod(rank - 1, world);
  for (int s = 0; s < world - 1; ++s) {
    const Chunk out = chunks[ring_mod(rank - s, world)];     // ours at s = 0, then what we received
    const Chunk in = chunks[ring_mod(rank - s - 1, world)];  // prev's chunk, one hop further on
    c10::intrusive_ptr<c10d::Work> send, recv;
    std::vector<at::Tensor> send_buf{flat.narrow(0, out.offset, out.size)};
    std::vector<at::Tensor> recv_buf{flat.narrow(0, in.offset, in.size)};  // written in place
    if (out.size > 0) send = comm.send(send_buf, next, kAllGatherTag + s);
    if (in.size > 0) recv = comm.recv(recv_buf, prev, kAllGatherTag + s);
    if (send) send->wait();
    if (recv) recv->wait();
  }
  // END SOLUTION
}

void ring_allreduce(Comm& comm, const at::Tensor& flat) {
  check_flat(flat, "ring_allreduce");
  // BEGIN SOLUTION: flat becomes, on every rank, the elementwise sum over the ranks, from the
  //   two ring functions above (L03Ring.Allreduce*; hints: README section 7)
  ring_reduce_scatter(comm, flat);  // chunk r of flat is complete on rank r
  ring_all_gather(comm, flat);      // ... and now every chunk is, everywhere
  // END SOLUTION
}

}  // namespace dtc::l03
