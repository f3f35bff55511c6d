// Lesson 12's checkpoint on its own: the boxes, a shard's bytes, the commit under a crash at every
// point of the save protocol, every corruption named, and the ranks' order across a save.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint.h"
#include "dtc/ranks.h"
#include "memory_fs.h"

namespace dtc::l12 {
namespace {

using test::Crashed;
using test::MemoryFs;

// ---------------------------------------------------------------------------------------------
// Boxes
// ---------------------------------------------------------------------------------------------

// The overlap, written out element by element: the indices both boxes hold (of a tensor big
// enough for both), as a box, or nothing.
std::optional<Box> brute_overlap(const Box& a, const Box& b) {
  Box out;
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    int64_t lo = -1, hi = -1;
    for (int64_t i = 0; i < 64; ++i) {
      const bool in_a = i >= a.offsets[d] && i < a.offsets[d] + a.sizes[d];
      const bool in_b = i >= b.offsets[d] && i < b.offsets[d] + b.sizes[d];
      if (in_a && in_b) {
        if (lo < 0) lo = i;
        hi = i + 1;
      }
    }
    if (lo < 0) return std::nullopt;
    out.offsets.push_back(lo);
    out.sizes.push_back(hi - lo);
  }
  return out;
}

TEST(L12Boxes, TheOverlapIsTheElementsBothHold) {
  const std::vector<std::pair<Box, Box>> cases = {
      {{{0}, {8}}, {{4}, {8}}},              // a tail
      {{{4}, {8}}, {{0}, {8}}},              // the other way round
      {{{0}, {4}}, {{4}, {4}}},              // touching: nothing
      {{{2}, {3}}, {{0}, {10}}},             // inside
      {{{0, 0}, {4, 6}}, {{2, 3}, {4, 6}}},  // a corner
      {{{0, 0}, {4, 6}}, {{0, 6}, {4, 6}}},  // side by side: nothing
      {{{0, 2}, {8, 2}}, {{3, 0}, {2, 8}}},  // a cross
      {{{0, 1, 0}, {3, 2, 5}}, {{1, 0, 4}, {1, 8, 1}}},
      {{{0, 0, 0}, {3, 2, 5}}, {{0, 2, 0}, {3, 2, 5}}},  // rows of q, k, v of another tp rank
      {{{0}, {0}}, {{0}, {4}}},                          // empty
  };
  for (const auto& [a, b] : cases) {
    const std::optional<Box> got = intersect(a, b);
    const std::optional<Box> want = brute_overlap(a, b);
    SCOPED_TRACE(fmt::format("[{}]+[{}] and [{}]+[{}]", fmt::join(a.offsets, ","),
                             fmt::join(a.sizes, ","), fmt::join(b.offsets, ","),
                             fmt::join(b.sizes, ",")));
    ASSERT_EQ(got.has_value(), want.has_value());
    if (want) EXPECT_EQ(*got, *want);
  }
  EXPECT_THROW(intersect({{0}, {4}}, {{0, 0}, {4, 4}}), std::invalid_argument);
}

// The given decomposition of a ZeRO shard: the boxes' elements, row-major, are the range's.
TEST(L12BoxesGiven, AFlatRangeIsAFewBoxesInOrder) {
  const std::vector<int64_t> shape{3, 4, 5};
  for (int64_t begin = 0; begin <= 60; begin += 7) {
    for (int64_t end = begin; end <= 60; end += 11) {
      const auto all = torch::arange(60).view(shape);
      std::vector<torch::Tensor> parts;
      const auto boxes = flat_range_boxes(shape, begin, end);
      EXPECT_LE(boxes.size(), 5u);
      for (const Box& b : boxes) {
        torch::Tensor t = all;
        for (size_t d = 0; d < 3; ++d) t = t.narrow(d, b.offsets[d], b.sizes[d]);
        parts.push_back(t.reshape({-1}));
      }
      const auto got = parts.empty() ? torch::empty({0}, torch::kLong) : torch::cat(parts);
      EXPECT_TRUE(torch::equal(got, torch::arange(begin, end))) << begin << ".." << end;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// A shard and the commit
// ---------------------------------------------------------------------------------------------

// The pieces of a small state of three tensors over @p ranks ranks: each rank a row block of a
// (6, 4) matrix and of a (6) vector, and rank 0 the whole of a (3, 2, 2) tensor, filled with
// @p base + their global index.
std::vector<std::vector<StatePiece>> small_state(int ranks, float base) {
  std::vector<std::vector<StatePiece>> out(static_cast<size_t>(ranks));
  const auto w = torch::arange(24, torch::kFloat).view({6, 4}) + base;
  const auto v = torch::arange(6, torch::kFloat) + base;
  const auto q = torch::arange(12, torch::kFloat).view({3, 2, 2}) + base;
  const int64_t rows = 6 / ranks;
  for (int r = 0; r < ranks; ++r) {
    auto& p = out[static_cast<size_t>(r)];
    p.push_back(
        {"model/w", {6, 4}, {{r * rows, 0}, {rows, 4}}, w.narrow(0, r * rows, rows).clone()});
    p.push_back({"model/v", {6}, {{r * rows}, {rows}}, v.narrow(0, r * rows, rows).clone()});
    p.push_back({"model/q", {3, 2, 2}, {{0, 0, 0}, {3, 2, 2}}, q.clone(), r == 0});
  }
  return out;
}

// Empty pieces of the same state for one rank that holds all of it.
std::vector<StatePiece> whole_state() {
  return {{"model/w", {6, 4}, {{0, 0}, {6, 4}}, torch::zeros({6, 4})},
          {"model/v", {6}, {{0}, {6}}, torch::zeros({6})},
          {"model/q", {3, 2, 2}, {{0, 0, 0}, {3, 2, 2}}, torch::zeros({3, 2, 2})}};
}

// Saves @p state at @p step as save_checkpoint() orders it across ranks, one rank after another
// in this thread: every shard, then rank 0's commit.
void save_in_order(Fs& fs, const std::vector<std::vector<StatePiece>>& state, int64_t step) {
  const std::string dir = step_dir("ckpt", step);
  fs.mkdirs(dir);
  Metadata m;
  m.step = step;
  m.train = {{"step", step}};
  for (size_t r = 0; r < state.size(); ++r) {
    m.files.push_back(write_shard(fs, dir, static_cast<int>(r), state[r]));
  }
  commit(fs, dir, m);
}

// The value a loaded state holds: its first element (base), or -1 when it does not load.
float loaded_base(MemoryFs& fs, int64_t step) {
  std::vector<StatePiece> pieces = whole_state();
  load_checkpoint(fs, step_dir("ckpt", step), pieces);
  const float base = pieces[0].tensor.view({-1})[0].item<float>();
  // Every element of every tensor of one save: base + its index.
  EXPECT_TRUE(torch::equal(pieces[0].tensor, torch::arange(24, torch::kFloat).view({6, 4}) + base));
  EXPECT_TRUE(torch::equal(pieces[1].tensor, torch::arange(6, torch::kFloat) + base));
  EXPECT_TRUE(
      torch::equal(pieces[2].tensor, torch::arange(12, torch::kFloat).view({3, 2, 2}) + base));
  return base;
}

TEST(L12Save, AShardIsItsPiecesBytesWithTheirChecksums) {
  MemoryFs fs("ckpt");
  fs.mkdirs("ckpt/s");
  const auto state = small_state(2, 100);
  const ShardFile f = write_shard(fs, "ckpt/s", 0, state[0]);
  EXPECT_EQ(f.file, "shard_00000.bin");
  const std::string bytes = fs.contents("ckpt/s/shard_00000.bin");
  ASSERT_EQ(f.pieces.size(), 3u);  // rank 0 writes q too
  int64_t at = 0;
  for (size_t i = 0; i < 3; ++i) {
    const SavedPiece& p = f.pieces[i];
    const torch::Tensor& t = state[0][i].tensor;
    SCOPED_TRACE(p.key);
    EXPECT_EQ(p.key, state[0][i].key);
    EXPECT_EQ(p.box, state[0][i].box);
    EXPECT_EQ(p.global_shape, state[0][i].global_shape);
    EXPECT_EQ(p.file, f.file);
    EXPECT_EQ(p.offset, at);
    EXPECT_EQ(p.bytes, t.numel() * 4);
    const std::string mine(static_cast<const char*>(t.data_ptr()),
                           static_cast<size_t>(t.numel() * 4));
    ASSERT_LE(at + p.bytes, static_cast<int64_t>(bytes.size()));
    EXPECT_EQ(bytes.substr(static_cast<size_t>(at), static_cast<size_t>(p.bytes)), mine);
    EXPECT_EQ(p.crc32, crc32_of(mine));
    at += p.bytes;
  }
  EXPECT_EQ(f.bytes, at);
  EXPECT_EQ(static_cast<int64_t>(bytes.size()), at);
  // Rank 1 leaves q to rank 0.
  const ShardFile g = write_shard(fs, "ckpt/s", 1, state[1]);
  EXPECT_EQ(g.pieces.size(), 2u);
  // Its bytes survive a crash once its name does (the commit makes the names durable).
  fs.fsync_dir("ckpt/s");
  fs.fsync_dir("ckpt");
  fs.crash();
  EXPECT_EQ(fs.contents("ckpt/s/shard_00000.bin"), bytes);
  EXPECT_EQ(fs.contents("ckpt/s/shard_00001.bin").size(), static_cast<size_t>(g.bytes));
}

// A crash before every operation of a save of step 2 over three ranks, with step 1 committed: the
// newest committed checkpoint is step 1 or (once the commit is durable) step 2, and it loads whole;
// a save that returned survives the crash. Each crash point twice: with only the durable names
// left, and with every name left but the bytes that no fsync made durable gone (a metadata.json
// renamed into place before its bytes were durable comes back empty, and hides step 1).
TEST(L12Crash, ACrashAtEveryPointOfTheSaveLeavesACheckpointThatLoads) {
  int cases = 0, old_kept = 0, new_kept = 0, total_ops = 0;
  {
    MemoryFs probe("ckpt");
    save_in_order(probe, small_state(3, 100), 1);
    probe.crash_at(0);
    save_in_order(probe, small_state(3, 200), 2);
    total_ops = probe.ops();
  }
  ASSERT_GE(total_ops, 9) << "three shards written and made durable, and the metadata committed";
  for (int k = 1; k <= total_ops + 1; ++k) {
    for (const MemoryFs::Names names : {MemoryFs::Names::kDurable, MemoryFs::Names::kAll}) {
      SCOPED_TRACE(fmt::format(
          "a crash before operation {} of {}, {}", k, total_ops,
          names == MemoryFs::Names::kAll ? "every name kept" : "the durable names kept"));
      MemoryFs fs("ckpt");
      save_in_order(fs, small_state(3, 100), 1);
      fs.crash_at(k);
      bool returned = false;
      try {
        save_in_order(fs, small_state(3, 200), 2);
        returned = true;
      } catch (const Crashed&) {
      }
      fs.crash(names);
      ++cases;
      const std::optional<int64_t> latest = latest_checkpoint(fs, "ckpt");
      ASSERT_TRUE(latest.has_value()) << "no checkpoint left";
      if (returned) EXPECT_EQ(*latest, 2) << "a save that returned was lost";
      float base = 0;
      try {
        base = loaded_base(fs, *latest);
      } catch (const CheckpointError& e) {
        ADD_FAILURE() << "the newest committed checkpoint, step " << *latest
                      << ", does not load: " << e.what();
        continue;
      }
      EXPECT_EQ(base, *latest == 1 ? 100.f : 200.f);
      (*latest == 1 ? old_kept : new_kept)++;
    }
  }
  // Both outcomes happen: before the commit the old one, after it the new one.
  EXPECT_GT(old_kept, 0);
  EXPECT_GT(new_kept, 0);
  EXPECT_EQ(cases, 2 * (total_ops + 1));
  std::cout << "[ crashes  ] " << cases << " crashes tried (" << total_ops + 1
            << " points, two ways), " << old_kept << " kept step 1, " << new_kept
            << " kept step 2, every one loads\n";
}

TEST(L12Latest, OnlyCommittedStepDirectoriesCount) {
  MemoryFs fs("ckpt");
  EXPECT_FALSE(latest_checkpoint(fs, "ckpt").has_value());
  EXPECT_FALSE(latest_checkpoint(fs, "nowhere").has_value());
  save_in_order(fs, small_state(2, 1), 4);
  save_in_order(fs, small_state(2, 1), 12);
  fs.mkdirs("ckpt/step_00000020");  // begun, never committed
  fs.write("ckpt/step_00000020/shard_00000.bin", "x");
  fs.mkdirs("ckpt/other");
  fs.write("ckpt/other/metadata.json", "{}");
  fs.mkdirs("ckpt/step_00000030.tmp");
  fs.write("ckpt/step_00000030.tmp/metadata.json", "{}");
  fs.write("ckpt/step_00000040", "a file, not a directory");
  EXPECT_EQ(latest_checkpoint(fs, "ckpt"), std::optional<int64_t>(12));
}

// ---------------------------------------------------------------------------------------------
// Corruption: an error that names the file, never a load
// ---------------------------------------------------------------------------------------------

void expect_error_naming(MemoryFs& fs, int64_t step, const std::string& file,
                         const std::string& what) {
  SCOPED_TRACE(what);
  std::vector<StatePiece> pieces = whole_state();
  try {
    load_checkpoint(fs, step_dir("ckpt", step), pieces);
    ADD_FAILURE() << what << ": loaded";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(file), std::string::npos)
        << what << ": the error does not name " << file << ": " << e.what();
  }
}

TEST(L12Corrupt, EveryCorruptionIsAnErrorNamingTheFile) {
  int tried = 0;
  const auto fresh = [] {
    auto fs = std::make_unique<MemoryFs>("ckpt");
    save_in_order(*fs, small_state(3, 100), 2);
    return fs;
  };
  for (int r = 0; r < 3; ++r) {
    const std::string name = shard_name(r);
    const std::string path = "ckpt/step_00000002/" + name;
    {  // truncated by one byte
      auto fs = fresh();
      const std::string bytes = fs->contents(path);
      fs->corrupt(path, bytes.substr(0, bytes.size() - 1));
      expect_error_naming(*fs, 2, name, "truncated " + name);
      ++tried;
    }
    {  // longer than the metadata says (another save's file in its place): not this checkpoint
      auto fs = fresh();
      fs->corrupt(path, fs->contents(path) + std::string(4, '\0'));
      expect_error_naming(*fs, 2, name, "4 bytes appended to " + name);
      ++tried;
    }
    {  // missing
      auto fs = fresh();
      fs->remove(path);
      expect_error_naming(*fs, 2, name, "missing " + name);
      ++tried;
    }
    // One flipped bit in every piece of the file, at its first and at its last byte.
    auto probe = fresh();
    const std::string bytes = probe->contents(path);
    std::vector<size_t> positions;
    const std::vector<StatePiece> state = small_state(3, 100)[static_cast<size_t>(r)];
    size_t at = 0;
    for (const StatePiece& p : state) {
      if (!p.write) continue;
      positions.push_back(at);
      at += static_cast<size_t>(p.tensor.numel() * 4);
      positions.push_back(at - 1);
    }
    for (size_t pos : positions) {
      auto fs = fresh();
      std::string flipped = bytes;
      flipped[pos] = static_cast<char>(flipped[pos] ^ 0x10);
      fs->corrupt(path, flipped);
      expect_error_naming(*fs, 2, name, fmt::format("byte {} of {} flipped", pos, name));
      ++tried;
    }
  }
  {  // the metadata of another step
    auto fs = fresh();
    save_in_order(*fs, small_state(3, 100), 3);
    fs->corrupt("ckpt/step_00000002/metadata.json",
                fs->contents("ckpt/step_00000003/metadata.json"));
    expect_error_naming(*fs, 2, "metadata.json", "step 3's metadata in step 2's directory");
    ++tried;
  }
  {  // no metadata
    auto fs = fresh();
    fs->remove("ckpt/step_00000002/metadata.json");
    expect_error_naming(*fs, 2, "metadata.json", "no metadata");
    ++tried;
  }
  {  // a tensor the checkpoint does not hold
    auto fs = fresh();
    std::vector<StatePiece> pieces = whole_state();
    pieces.push_back({"model/absent", {2}, {{0}, {2}}, torch::zeros({2})});
    EXPECT_THROW(load_checkpoint(*fs, step_dir("ckpt", 2), pieces), CheckpointError);
    ++tried;
  }
  {  // a tensor it holds only part of: rank 2 never wrote its rows of w
    MemoryFs fs("ckpt");
    auto state = small_state(3, 100);
    state[2][0].write = false;
    save_in_order(fs, state, 2);
    std::vector<StatePiece> pieces = whole_state();
    EXPECT_THROW(load_checkpoint(fs, step_dir("ckpt", 2), pieces), CheckpointError)
        << "rows 4 and 5 of w are in no saved piece";
    ++tried;
  }
  {  // a tensor of another whole shape (another model)
    auto fs = fresh();
    std::vector<StatePiece> pieces = whole_state();
    pieces[0] = {"model/w", {8, 3}, {{0, 0}, {6, 3}}, torch::zeros({6, 3})};
    EXPECT_THROW(load_checkpoint(*fs, step_dir("ckpt", 2), pieces), CheckpointError);
    ++tried;
  }
  std::cout << "[ corrupt  ] " << tried << " corruptions tried, every one an error\n";
}

// ---------------------------------------------------------------------------------------------
// Loading: each rank reads only what overlaps its pieces
// ---------------------------------------------------------------------------------------------

TEST(L12Load, ARankReadsOnlyTheSavedPiecesThatOverlapItsOwn) {
  MemoryFs fs("ckpt");
  save_in_order(fs, small_state(3, 100), 2);  // w and v in row blocks of 2, q whole on rank 0
  // Rows 3 and 4 of w: saved pieces of ranks 1 and 2 (rows 2-3 and 4-5); of v nothing.
  std::vector<StatePiece> pieces{{"model/w", {6, 4}, {{3, 0}, {2, 4}}, torch::zeros({2, 4})}};
  fs.clear_reads();
  load_checkpoint(fs, step_dir("ckpt", 2), pieces);
  EXPECT_TRUE(
      torch::equal(pieces[0].tensor, torch::arange(12, 20, torch::kFloat).view({2, 4}) + 100));
  const int64_t metadata = fs.size("ckpt/step_00000002/metadata.json");
  // The metadata, and two pieces of 2 x 4 floats, each once.
  EXPECT_EQ(fs.bytes_read(0), metadata + 2 * 32);
  // Reading a piece twice for two pieces of the rank that overlap it: still once.
  pieces = {{"model/w", {6, 4}, {{2, 0}, {1, 4}}, torch::zeros({1, 4})},
            {"model/w", {6, 4}, {{3, 0}, {1, 4}}, torch::zeros({1, 4})}};
  fs.clear_reads();
  load_checkpoint(fs, step_dir("ckpt", 2), pieces);
  EXPECT_EQ(fs.bytes_read(0), metadata + 32);
}

// ---------------------------------------------------------------------------------------------
// The protocol across ranks
// ---------------------------------------------------------------------------------------------

// Three thread-ranks save, the last one's shard slow to write: the metadata is committed after
// every shard is durable, and no rank returns before the commit is durable.
TEST(L12Save, TheCommitWaitsForEveryShardAndEveryRankForTheCommit) {
  MemoryFs fs("ckpt");
  fs.slow_writes("shard_00002", std::chrono::milliseconds(300));        // the last shard is late
  fs.slow_writes("metadata.json.tmp", std::chrono::milliseconds(300));  // and so is the commit
  const auto state = small_state(3, 100);
  std::vector<size_t> returned_at(3);
  run_ranks(3, [&](RankContext& ctx) {
    MemoryFs::thread_rank() = ctx.rank;
    save_checkpoint(fs, "ckpt", 5, state[static_cast<size_t>(ctx.rank)], *ctx.comm, {{"step", 5}});
    returned_at[static_cast<size_t>(ctx.rank)] = fs.log().size();
  });
  const std::vector<std::string> log = fs.log();
  auto index_of = [&](const std::string& op) {
    const auto it = std::find(log.begin(), log.end(), op);
    return it == log.end() ? log.size() : static_cast<size_t>(it - log.begin());
  };
  const std::string dir = "ckpt/step_00000005";
  const size_t rename = index_of("rename " + dir + "/metadata.json.tmp " + dir + "/metadata.json");
  ASSERT_LT(rename, log.size()) << "the metadata was never renamed into place";
  for (int r = 0; r < 3; ++r) {
    const size_t synced = index_of("fsync " + dir + "/" + shard_name(r));
    ASSERT_LT(synced, log.size()) << shard_name(r) << " was never made durable";
    EXPECT_LT(synced, rename) << "committed before " << shard_name(r) << " was durable";
  }
  // The first fsync of the step directory after the rename (one before it, for the shards' names,
  // is allowed: it does not make the rename durable).
  size_t dir_synced = log.size();
  for (size_t i = rename + 1; i < log.size(); ++i) {
    if (log[i] == "fsync_dir " + dir) {
      dir_synced = i;
      break;
    }
  }
  ASSERT_LT(dir_synced, log.size()) << "the rename was never made durable";
  for (int r = 0; r < 3; ++r) {
    EXPECT_GT(returned_at[static_cast<size_t>(r)], dir_synced)
        << "rank " << r << " returned before the commit was durable";
  }
  fs.crash();
  EXPECT_EQ(latest_checkpoint(fs, "ckpt"), std::optional<int64_t>(5));
  EXPECT_EQ(loaded_base(fs, 5), 100.f);
}

}  // namespace
}  // namespace dtc::l12
