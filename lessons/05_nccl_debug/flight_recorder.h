// Lesson 05, the contract of your third part: reading PyTorch's Flight Recorder after a hang, as
// its analyzer (torchfrtrace) does: which collective, which ranks never called it, which wait
// in it, and whether the ranks even agree on what it is.
//
// Every rank's process keeps a ring buffer of its recent collectives (README section 7). Dumped
// as JSON (c10d::dump_fr_trace_json, dtc::flight_recorder_json()), one rank's trace holds:
//   "pg_status": {"0": {"last_enqueued_collective": "2", "last_completed_collective": "1", ...}}
//   "entries": [{"pg_id": 0, "collective_seq_id": 2, "profiling_name": "gloo:broadcast",
//                "input_sizes": [[2]], "input_dtypes": ["Float"], "retired": false, ...}, ...]
// Sequence numbers count each group's collectives from 1, on each rank separately.
//
// You write analyze_flight_recorder() in flight_recorder.cpp (TODO(L05)).
//   make test-lesson05                 # tests/lesson05/flight_recorder_test.cpp
//   (L05FlightRecorder.*)
//   build/bin/lesson05 fault --case skip-collective --no-check --fr-dump DIR   (under torchrun)
//   build/bin/lesson05 fr-analyze DIR/rank*.json                              # your analysis
#pragma once

#include <map>
#include <string>
#include <vector>

namespace dtc::l05 {

/// One rank's Flight Recorder dump: the JSON text of dump_fr_trace_json() in that rank's process.
struct FrDump {
  int rank = 0;
  std::string json;
};

/// What the dumps of all ranks say about one process group.
struct FrVerdict {
  /// Every rank completed every collective that any rank enqueued: nothing is stuck.
  bool all_completed = false;
  /// The first sequence number that not every rank completed (0 when all_completed).
  long long seq = 0;
  /// Rank -> its call at seq, "profiling_name(Dtype[sizes], ...)", e.g.
  /// "gloo:broadcast(Float[2])", for the ranks that enqueued seq; "?" when that rank's entry is no
  /// longer in its ring buffer.
  std::map<int, std::string> calls;
  std::vector<int> missing;  ///< ranks that never enqueued seq (their last enqueued is below it)
  std::vector<int> waiting;  ///< ranks that enqueued seq and did not complete it
  /// The ranks that enqueued seq disagree on the call (a different op, or other sizes or dtypes):
  /// a rank skipped or added a collective before seq, or called it with other tensors.
  bool mismatch = false;
};

/// Lines up the dumps of a job's ranks for group @p pg_id (TODO(L05)).
///
/// A rank's progress in the group is its pg_status: last enqueued and last completed sequence
/// numbers (strings in the JSON; "-1" or absent counts as 0). seq is the smallest last completed
/// plus one, over all ranks; all_completed holds when every rank's last completed equals the
/// largest last enqueued of any rank (seq is then 0 and the lists empty). A rank whose dump has no
/// entry for @p pg_id in pg_status has enqueued nothing in it.
/// The call at seq is the entry with that pg_id and collective_seq_id (not a p2p one):
/// profiling_name, then each input's dtype and sizes: "gloo:all_reduce(Float[4, 8], Long[2])".
/// What this assumes, as the fault lab's dumps satisfy it: the group's ops are collectives (no
/// send/recv: on NCCL, p2p ops move pg_status's counters too) run one at a time (gloo records a
/// completion when its worker finishes an op, so with several async ops in flight the counter can
/// pass a stuck earlier one), and @p pg_id names the same group in every rank's process (it is
/// process-local: in a job with subgroups, match groups by pg_config's name instead). A rank
/// that is in no dump is not seen at all; sizes are compared as they are, which would flag the
/// legitimately uneven inputs of scatter, gather or all_to_all. torchfrtrace handles all of
/// these; this is its first step.
/// @param dumps one per rank, any order, each rank once
/// @throws std::invalid_argument when there is no dump, a dump is not JSON, has no "pg_status"
///   or a counter that is not a number, or a rank appears twice; the message names the rank.
FrVerdict analyze_flight_recorder(const std::vector<FrDump>& dumps, const std::string& pg_id = "0");

/// One paragraph for a person, e.g.
///   "collective #2: rank(s) 1 never called it; rank(s) 0 wait in gloo:broadcast(Float[2])"
///   "collective #1 differs across ranks: rank 0 gloo:all_reduce(Float[4]); rank 1
///    gloo:broadcast(Float[2])"
/// Given in full (flight_recorder_given.cpp).
std::string describe(const FrVerdict& verdict);

}  // namespace dtc::l05
