// Lesson 05, the contract: two debugging aids that turn a hang into a diagnosis.
//
//   1. barrier_with_report(): a barrier through the store that, instead of waiting forever for a
//      rank that died or never started, gives up after a timeout and names the ranks that never
//      arrived (MissingRanksError).
//   2. check_fingerprint(): what TORCH_DISTRIBUTED_DEBUG=DETAIL does before every collective:
//      each rank publishes (sequence number, op, shapes, dtypes) of the call it is about to make
//      and compares it with every other rank's; a mismatch fails at once, naming the ranks and
//      the calls (CollectiveMismatchError) instead of deadlocking or reducing garbage.
//
// You write the two functions marked TODO(L05) in debug_aids.cpp; everything else here is given.
//   make test-lesson05                 # tests/lesson05/debug_aids_test.cpp
#pragma once

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtc/compat.h"

namespace dtc::l05 {

/// Thrown by barrier_with_report() when some ranks did not arrive in time.
class MissingRanksError : public std::runtime_error {
 public:
  MissingRanksError(const std::string& message, std::vector<int> missing)
      : std::runtime_error(message), missing_(std::move(missing)) {}
  /// The ranks that never arrived, ascending.
  const std::vector<int>& missing() const { return missing_; }

 private:
  std::vector<int> missing_;
};

/// Thrown by check_fingerprint() when the ranks are not about to make the same collective call.
class CollectiveMismatchError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// What one rank is about to call: the identity of a collective, as TORCH_DISTRIBUTED_DEBUG=DETAIL
/// compares it. Given in full.
struct Fingerprint {
  int64_t seq = 0;                           ///< 0, 1, 2, ...: this rank's n-th collective
  std::string op;                            ///< "allreduce", "broadcast", ...
  std::vector<std::vector<int64_t>> shapes;  ///< one per tensor argument
  std::vector<std::string> dtypes;           ///< one per tensor argument, e.g. "Float"

  /// One line, e.g. "#3 allreduce(Float[4, 8])": what the error messages print.
  std::string describe() const;
  /// A compact string for the store (one line, no spaces); decode() reverses it.
  std::string encode() const;
  /// @throws std::invalid_argument for a string that encode() did not produce.
  static Fingerprint decode(const std::string& text);
  bool operator==(const Fingerprint& other) const;
  bool operator!=(const Fingerprint& other) const { return !(*this == other); }
};

/// The fingerprint of calling @p op on @p tensors as this rank's @p seq-th collective. Given.
Fingerprint fingerprint_of(int64_t seq, const std::string& op,
                           const std::vector<at::Tensor>& tensors);

/// The store key under which rank @p rank announces its arrival at barrier @p name. Given:
/// "barrier/<name>/<rank>".
std::string barrier_key(const std::string& name, int rank);

/// The store key under which rank @p rank publishes the fingerprint of its collective number
/// @p seq. Given: "fingerprint/<seq>/<rank>".
std::string fingerprint_key(int64_t seq, int rank);

/// A barrier over the store that reports who is missing (TODO(L05)).
///
/// Rank @p rank announces itself by setting barrier_key(name, rank), then waits until all of
/// barrier_key(name, 0 .. world-1) exist, checking the store every few milliseconds (never a
/// blocking wait without a deadline).
/// @param store shared by the @p world ranks (a HashStore in tests, the job's TCPStore in runs)
/// @param name the barrier's name: each barrier of a run needs its own
/// @param rank this rank, 0 .. world-1
/// @param world how many ranks must arrive
/// @param timeout how long to wait for the others, from the call
/// @throws MissingRanksError after @p timeout if some ranks have not arrived; missing() lists them
///   in ascending order, and the message reads "barrier '<name>': rank(s) 2, 3 of 4 never arrived
///   within <timeout> ms (seen from rank 0)".
/// @throws std::invalid_argument when rank is not in [0, world).
void barrier_with_report(c10d::Store& store, const std::string& name, int rank, int world,
                         std::chrono::milliseconds timeout);

/// Compares this rank's next collective with every other rank's (TODO(L05)).
///
/// Rank @p rank sets fingerprint_key(mine.seq, rank) to mine.encode(), then waits (polling, as
/// above) for the keys of all @p world ranks at the same sequence number, decodes them and
/// compares them with its own.
/// @param mine the call this rank is about to make (fingerprint_of())
/// @throws MissingRanksError after @p timeout when some ranks never published collective
///   mine.seq: their ranks, ascending, and a message that names them and the call that the others
///   are waiting in ("rank(s) 1 of 2 never reached collective #0 allreduce(Float[4])").
/// @throws CollectiveMismatchError when the fingerprints differ: the message groups the ranks by
///   the call they made, one line per distinct call, e.g.
///     "collective #0 differs across ranks:\n  rank(s) 0, 2: allreduce(Float[4])\n
///      rank(s) 1: allreduce(Float[8])"
void check_fingerprint(c10d::Store& store, int rank, int world, const Fingerprint& mine,
                       std::chrono::milliseconds timeout);

/// Checked collectives: a communicator, its store and a sequence counter. Each call fingerprints
/// itself with check_fingerprint() and then runs the real collective. Given in full.
class CheckedComm {
 public:
  CheckedComm(c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<Comm> comm,
              std::chrono::milliseconds timeout, bool check = true);
  /// allreduce SUM of @p tensors, in place.
  void allreduce(std::vector<at::Tensor>& tensors);
  /// broadcast of @p tensors from @p root, in place.
  void broadcast(std::vector<at::Tensor>& tensors, int root);
  /// The number of collectives called so far.
  int64_t calls() const { return seq_; }

 private:
  void before(const std::string& op, const std::vector<at::Tensor>& tensors);
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<Comm> comm_;
  std::chrono::milliseconds timeout_;
  bool check_;
  int64_t seq_ = 0;
};

/// "1, 3, 4": ranks for messages. Given.
std::string join_ranks(const std::vector<int>& ranks);

}  // namespace dtc::l05
