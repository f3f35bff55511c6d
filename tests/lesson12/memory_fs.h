// A file system in memory that keeps, on a crash, only what was made durable (as a machine that
// loses power does), injects that crash before any chosen operation, and counts what each rank
// reads. Lesson 12's tests save and load through it (dtc::l12::Fs), from outside the learner's
// code: what a crash leaves, and which bytes a load read, are observed, not reported.
//
// What survives a crash: a file's bytes as of its last fsync() (none: the file is empty); a name
// in a directory (made by write(), mkdirs() or rename()) as of that directory's last fsync_dir(),
// or, in the other mode (Names::kAll), every name as it was: a name may outlive its bytes, which
// is what a rename before the fsync of its file meets. The root directory always exists.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint.h"

namespace dtc::test {

using l12::CheckpointError;

/// Thrown by an operation that the crash point stops.
struct Crashed {};

class MemoryFs : public l12::Fs {
 public:
  explicit MemoryFs(std::string root) : root_(std::move(root)) {
    live_[root_];
    durable_[root_];
  }

  /// The rank the calling thread reads for (for bytes_read()).
  static int& thread_rank() {
    thread_local int rank = 0;
    return rank;
  }

  // --- the crash ---------------------------------------------------------------------------
  /// Every mutating operation from now on counts; the one numbered @p n (1 = the next) throws
  /// Crashed instead of running, and so does every operation after it. 0: never.
  void crash_at(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    crash_at_ = n;
    ops_ = 0;
    crashed_ = false;
  }
  /// Mutating operations counted since crash_at().
  int ops() const {
    std::lock_guard<std::mutex> lock(mu_);
    return ops_;
  }
  /// What a crash keeps of the names (files' bytes always go back to their last fsync()).
  enum class Names {
    kDurable,  ///< only what fsync_dir() made durable
    kAll,      ///< every name as it was (the journal had committed them), with their bytes
               ///< reverted all the same: ext4's zero-length files after a rename
  };
  /// The machine restarts: only what was durable is left, and operations run again.
  void crash(Names names = Names::kDurable) {
    std::lock_guard<std::mutex> lock(mu_);
    if (names == Names::kDurable) {
      std::map<std::string, Dir> after;
      keep(root_, after);
      live_ = after;
    }
    durable_ = live_;
    for (auto& [id, file] : files_) file.data = file.durable;
    crash_at_ = 0;
    crashed_ = false;
  }

  // --- what tests read and break -----------------------------------------------------------
  /// Bytes read by rank @p rank (thread_rank()) since clear_reads().
  int64_t bytes_read(int rank) const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = read_.find(rank);
    return it == read_.end() ? 0 : it->second;
  }
  void clear_reads() {
    std::lock_guard<std::mutex> lock(mu_);
    read_.clear();
  }
  /// The log of mutating operations: "write PATH", "fsync PATH", "fsync_dir DIR", "rename A B",
  /// "mkdirs DIR".
  std::vector<std::string> log() const {
    std::lock_guard<std::mutex> lock(mu_);
    return log_;
  }
  /// A file's bytes (throws when there is none).
  std::string contents(const std::string& path) const {
    std::lock_guard<std::mutex> lock(mu_);
    return files_.at(lookup(path)).data;
  }
  /// Replaces a file's bytes, durably (a test's corruption).
  void corrupt(const std::string& path, const std::string& bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    File& f = files_.at(lookup(path));
    f.data = bytes;
    f.durable = bytes;
  }
  /// Removes a file, durably.
  void remove(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto [dir, name] = split(path);
    live_.at(dir).erase(name);
    durable_[dir].erase(name);
  }
  /// Writes of a path that contains @p part wait @p delay first (a slow rank).
  void slow_writes(const std::string& part, std::chrono::milliseconds delay) {
    std::lock_guard<std::mutex> lock(mu_);
    slow_[part] = delay;
  }

  // --- Fs ------------------------------------------------------------------------------------
  void mkdirs(const std::string& dir) override {
    step("mkdirs " + dir);
    std::lock_guard<std::mutex> lock(mu_);
    std::string at;
    for (size_t pos = 0; pos != std::string::npos;) {
      const size_t next = dir.find('/', pos + 1);
      at = dir.substr(0, next);
      pos = next;
      if (live_.count(at)) continue;
      const auto [parent, name] = split(at);
      if (!live_.count(parent)) throw CheckpointError(at, "no parent directory");
      live_[parent][name] = Entry{true, 0};
      live_[at];
    }
  }
  void write(const std::string& path, const std::string& bytes) override {
    std::chrono::milliseconds delay{0};
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [part, d] : slow_) {
        if (path.find(part) != std::string::npos) delay = d;
      }
    }
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    step("write " + path);
    std::lock_guard<std::mutex> lock(mu_);
    const auto [dir, name] = split(path);
    auto d = live_.find(dir);
    if (d == live_.end()) throw CheckpointError(path, "no such directory");
    auto e = d->second.find(name);
    if (e == d->second.end()) {
      const int id = next_id_++;
      files_[id] = File{};
      e = d->second.emplace(name, Entry{false, id}).first;
    }
    files_.at(e->second.id).data = bytes;
  }
  void fsync(const std::string& path) override {
    step("fsync " + path);
    std::lock_guard<std::mutex> lock(mu_);
    File& f = files_.at(lookup(path));
    f.durable = f.data;
  }
  void fsync_dir(const std::string& dir) override {
    step("fsync_dir " + dir);
    std::lock_guard<std::mutex> lock(mu_);
    const auto d = live_.find(dir);
    if (d == live_.end()) throw CheckpointError(dir, "no such directory");
    durable_[dir] = d->second;
  }
  void rename(const std::string& from, const std::string& to) override {
    step("rename " + from + " " + to);
    std::lock_guard<std::mutex> lock(mu_);
    const auto [fdir, fname] = split(from);
    const auto [tdir, tname] = split(to);
    auto& source = live_.at(fdir);
    const auto e = source.find(fname);
    if (e == source.end()) throw CheckpointError(from, "no such file to rename");
    const Entry entry = e->second;
    source.erase(e);
    live_.at(tdir)[tname] = entry;
  }
  std::vector<std::string> list(const std::string& dir) override {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> names;
    const auto d = live_.find(dir);
    if (d == live_.end()) return names;
    for (const auto& [name, entry] : d->second) names.push_back(name);
    return names;
  }
  int64_t size(const std::string& path) override {
    std::lock_guard<std::mutex> lock(mu_);
    const int id = find(path);
    return id < 0 ? -1 : static_cast<int64_t>(files_.at(id).data.size());
  }
  std::string read(const std::string& path, int64_t offset, int64_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    const int id = find(path);
    if (id < 0) throw CheckpointError(path, "no such file");
    const std::string& data = files_.at(id).data;
    if (offset < 0 || bytes < 0 || offset + bytes > static_cast<int64_t>(data.size())) {
      throw CheckpointError(path, fmt::format("the file ends before byte {}", offset + bytes));
    }
    read_[thread_rank()] += bytes;
    return data.substr(static_cast<size_t>(offset), static_cast<size_t>(bytes));
  }

 private:
  struct Entry {
    bool is_dir = false;
    int id = 0;  // the file's, when not a directory
  };
  using Dir = std::map<std::string, Entry>;
  struct File {
    std::string data;
    std::string durable;
  };

  void step(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (crashed_) throw Crashed{};
    ++ops_;
    if (crash_at_ > 0 && ops_ >= crash_at_) {
      crashed_ = true;
      throw Crashed{};
    }
    log_.push_back(what);
  }
  static std::pair<std::string, std::string> split(const std::string& path) {
    const size_t slash = path.find_last_of('/');
    if (slash == std::string::npos) return {"", path};
    return {path.substr(0, slash), path.substr(slash + 1)};
  }
  int find(const std::string& path) const {
    const auto [dir, name] = split(path);
    const auto d = live_.find(dir);
    if (d == live_.end()) return -1;
    const auto e = d->second.find(name);
    if (e == d->second.end() || e->second.is_dir) return -1;
    return e->second.id;
  }
  int lookup(const std::string& path) const {
    const int id = find(path);
    if (id < 0) throw CheckpointError(path, "no such file");
    return id;
  }
  // The durable tree under @p dir into @p out.
  void keep(const std::string& dir, std::map<std::string, Dir>& out) const {
    const auto d = durable_.find(dir);
    out[dir] = d == durable_.end() ? Dir{} : d->second;
    for (const auto& [name, entry] : out[dir]) {
      if (entry.is_dir) keep(dir + "/" + name, out);
    }
  }

  mutable std::mutex mu_;
  std::string root_;
  std::map<std::string, Dir> live_;
  std::map<std::string, Dir> durable_;
  std::map<int, File> files_;
  int next_id_ = 1;
  int crash_at_ = 0;
  int ops_ = 0;
  bool crashed_ = false;
  std::map<int, int64_t> read_;
  std::vector<std::string> log_;
  std::map<std::string, std::chrono::milliseconds> slow_;
};

}  // namespace dtc::test
