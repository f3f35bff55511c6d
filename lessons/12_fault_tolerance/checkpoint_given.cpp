// Lesson 12's given building blocks: the file system (POSIX), CRC-32 (zlib), the metadata's JSON,
// the boxes of a flat range, and the all-gather of the shard files' records.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <numeric>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "checkpoint.h"

namespace dtc::l12 {

CheckpointError::CheckpointError(const std::string& path, const std::string& what)
    : std::runtime_error(fmt::format("{}: {}", path, what)), path_(path) {}

uint32_t crc32_of(const std::string& bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* data = reinterpret_cast<const Bytef*>(bytes.data());
  size_t left = bytes.size();
  while (left > 0) {  // zlib's length is a uInt
    const uInt n = static_cast<uInt>(std::min<size_t>(left, 1u << 30));
    crc = crc32(crc, data, n);
    data += n;
    left -= n;
  }
  return static_cast<uint32_t>(crc);
}

int64_t Box::numel() const {
  return std::accumulate(sizes.begin(), sizes.end(), int64_t{1}, std::multiplies<>());
}

// ---------------------------------------------------------------------------------------------
// PosixFs
// ---------------------------------------------------------------------------------------------

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& call) {
  throw CheckpointError(path, fmt::format("{} failed: {}", call, std::strerror(errno)));
}

// A file descriptor closed on every path out (close() checked where its error matters).
struct Fd {
  int fd;
  Fd(const std::string& path, int flags, const char* call) : fd(::open(path.c_str(), flags, 0644)) {
    if (fd < 0) fail(path, call);
  }
  void close(const std::string& path) {
    const int rc = ::close(fd);
    fd = -1;
    if (rc != 0) fail(path, "close");
  }
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

}  // namespace

void PosixFs::mkdirs(const std::string& dir) {
  // Each missing directory made, and its name made durable in its parent at once: on disk the
  // checkpoints' root itself may be new (MemoryFs, the tests' file system, leaves that to the
  // commit's fsync_dir of the root).
  std::filesystem::path at;
  for (const auto& part : std::filesystem::path(dir)) {
    at /= part;
    std::error_code ec;
    if (std::filesystem::is_directory(at, ec)) continue;
    if (!std::filesystem::create_directory(at, ec) && ec) {
      throw CheckpointError(at.string(), "cannot make the directory: " + ec.message());
    }
    const std::string parent = at.has_parent_path() ? at.parent_path().string() : ".";
    fsync_dir(parent.empty() ? "." : parent);
  }
}

void PosixFs::write(const std::string& path, const std::string& bytes) {
  Fd f(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, "open");
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(f.fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(path, "write");
    }
    done += static_cast<size_t>(n);
  }
  f.close(path);  // an error of a delayed write can show here
}

// Through a new descriptor: Fs separates writing from making durable. A writeback error between
// the two can then go unreported (PostgreSQL's "fsyncgate", 2018); a production writer fsyncs the
// descriptor it wrote through.
void PosixFs::fsync(const std::string& path) {
  Fd f(path, O_RDONLY | O_CLOEXEC, "open");
  if (::fsync(f.fd) != 0) fail(path, "fsync");
}

void PosixFs::fsync_dir(const std::string& dir) {
  Fd f(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC, "open");
  if (::fsync(f.fd) != 0) fail(dir, "fsync");
}

void PosixFs::rename(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) fail(from, "rename to " + to);
}

std::vector<std::string> PosixFs::list(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) return names;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    names.push_back(entry.path().filename().string());
  }
  if (ec) throw CheckpointError(dir, "cannot list the directory: " + ec.message());
  std::sort(names.begin(), names.end());
  return names;
}

int64_t PosixFs::size(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return -1;
  return static_cast<int64_t>(st.st_size);
}

std::string PosixFs::read(const std::string& path, int64_t offset, int64_t bytes) {
  if (offset < 0 || bytes < 0) {
    throw CheckpointError(path, fmt::format("a read of {} bytes at {}", bytes, offset));
  }
  Fd f(path, O_RDONLY | O_CLOEXEC, "open");
  std::string out(static_cast<size_t>(bytes), '\0');
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(f.fd, out.data() + done, out.size() - done,
                              static_cast<off_t>(offset) + static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(path, "pread");
    }
    if (n == 0) {
      throw CheckpointError(path, fmt::format("the file ends before byte {} (read {} bytes at {})",
                                              offset + bytes, bytes, offset));
    }
    done += static_cast<size_t>(n);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Names and metadata
// ---------------------------------------------------------------------------------------------

std::string step_dir(const std::string& root, int64_t step) {
  return fmt::format("{}/step_{:08d}", root, step);
}

std::string shard_name(int rank) { return fmt::format("shard_{:05d}.bin", rank); }

nlohmann::json to_json(const Metadata& m) {
  nlohmann::json files = nlohmann::json::array();
  for (const ShardFile& f : m.files) {
    nlohmann::json pieces = nlohmann::json::array();
    for (const SavedPiece& p : f.pieces) {
      pieces.push_back({{"key", p.key},
                        {"global_shape", p.global_shape},
                        {"offsets", p.box.offsets},
                        {"sizes", p.box.sizes},
                        {"dtype", p.dtype},
                        {"offset", p.offset},
                        {"bytes", p.bytes},
                        {"crc32", p.crc32}});
    }
    files.push_back({{"file", f.file}, {"bytes", f.bytes}, {"pieces", pieces}});
  }
  return {{"format", "dtc-checkpoint-1"}, {"step", m.step}, {"files", files}, {"train", m.train}};
}

Metadata metadata_from_json(const std::string& text, const std::string& path) {
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    if (j.value("format", "") != "dtc-checkpoint-1") {
      throw CheckpointError(path, "not a checkpoint's metadata (format is not dtc-checkpoint-1)");
    }
    Metadata m;
    m.step = j.at("step").get<int64_t>();
    m.train = j.value("train", nlohmann::json::object());
    for (const auto& f : j.at("files")) {
      ShardFile file;
      file.file = f.at("file").get<std::string>();
      file.bytes = f.at("bytes").get<int64_t>();
      for (const auto& p : f.at("pieces")) {
        SavedPiece piece;
        piece.key = p.at("key").get<std::string>();
        piece.global_shape = p.at("global_shape").get<std::vector<int64_t>>();
        piece.box.offsets = p.at("offsets").get<std::vector<int64_t>>();
        piece.box.sizes = p.at("sizes").get<std::vector<int64_t>>();
        piece.dtype = p.at("dtype").get<std::string>();
        piece.file = file.file;
        piece.offset = p.at("offset").get<int64_t>();
        piece.bytes = p.at("bytes").get<int64_t>();
        piece.crc32 = p.at("crc32").get<uint32_t>();
        // What the load will trust: each piece inside its tensor and its file, in float32.
        const size_t d = piece.global_shape.size();
        bool inside = piece.box.offsets.size() == d && piece.box.sizes.size() == d;
        for (size_t i = 0; inside && i < d; ++i) {
          inside = piece.box.offsets[i] >= 0 && piece.box.sizes[i] >= 0 &&
                   piece.box.offsets[i] + piece.box.sizes[i] <= piece.global_shape[i];
        }
        if (!inside || piece.dtype != "float32" || piece.bytes != piece.box.numel() * 4 ||
            piece.offset < 0 || piece.offset + piece.bytes > file.bytes) {
          throw CheckpointError(path,
                                fmt::format("{}'s record in {} is inconsistent (a box outside "
                                            "its tensor, a size, an offset or a dtype)",
                                            piece.key, file.file));
        }
        file.pieces.push_back(std::move(piece));
      }
      m.files.push_back(std::move(file));
    }
    return m;
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(path, fmt::format("unreadable metadata: {}", e.what()));
  }
}

// ---------------------------------------------------------------------------------------------
// Boxes of a flat range
// ---------------------------------------------------------------------------------------------

std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  std::vector<Box> boxes;
  if (begin >= end) return boxes;
  if (shape.empty()) return {Box{}};  // a scalar: its one element
  const std::vector<int64_t> rest(shape.begin() + 1, shape.end());
  const int64_t inner = std::accumulate(rest.begin(), rest.end(), int64_t{1}, std::multiplies<>());
  // Elements [b, e) of row @p row, as boxes of the row's shape with the row in front.
  auto within_row = [&](int64_t row, int64_t b, int64_t e) {
    for (Box sub : flat_range_boxes(rest, b, e)) {
      sub.offsets.insert(sub.offsets.begin(), row);
      sub.sizes.insert(sub.sizes.begin(), 1);
      boxes.push_back(std::move(sub));
    }
  };
  auto whole_rows = [&](int64_t first, int64_t last) {  // rows [first, last)
    Box box{{first}, {last - first}};
    box.offsets.resize(shape.size(), 0);
    box.sizes.insert(box.sizes.end(), rest.begin(), rest.end());
    boxes.push_back(std::move(box));
  };
  if (begin % inner != 0) {  // the first row's tail, or a piece of one row
    const int64_t row = begin / inner;
    const int64_t row_end = std::min(end, (row + 1) * inner);
    within_row(row, begin - row * inner, row_end - row * inner);
    begin = row_end;
  }
  if (end - begin >= inner) {
    const int64_t last = end / inner;
    whole_rows(begin / inner, last);
    begin = last * inner;
  }
  if (begin < end) within_row(begin / inner, 0, end - (begin / inner) * inner);
  return boxes;
}

// ---------------------------------------------------------------------------------------------
// Every rank's records
// ---------------------------------------------------------------------------------------------

std::vector<ShardFile> all_gather_files(const ShardFile& mine, Comm& comm) {
  Metadata one;
  one.files = {mine};
  const std::string text = to_json(one).dump();
  const int n = comm.getSize();
  // The lengths, then the texts padded to the longest.
  auto length = torch::tensor({static_cast<int64_t>(text.size())}, torch::kInt64);
  std::vector<std::vector<at::Tensor>> lengths(1);
  for (int r = 0; r < n; ++r) lengths[0].push_back(torch::zeros({1}, torch::kInt64));
  std::vector<at::Tensor> in{length};
  comm.allgather(lengths, in)->wait();
  int64_t longest = 0;
  for (const auto& l : lengths[0]) longest = std::max(longest, l.item<int64_t>());
  auto bytes = torch::zeros({longest}, torch::kUInt8);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  std::vector<std::vector<at::Tensor>> texts(1);
  for (int r = 0; r < n; ++r) texts[0].push_back(torch::zeros({longest}, torch::kUInt8));
  std::vector<at::Tensor> in_text{bytes};
  comm.allgather(texts, in_text)->wait();
  std::vector<ShardFile> files;
  for (int r = 0; r < n; ++r) {
    const std::string t(static_cast<const char*>(texts[0][r].data_ptr()),
                        static_cast<size_t>(lengths[0][r].item<int64_t>()));
    Metadata theirs = metadata_from_json(t, fmt::format("rank {}'s shard record", r));
    files.push_back(std::move(theirs.files.at(0)));
  }
  return files;
}

}  // namespace dtc::l12
