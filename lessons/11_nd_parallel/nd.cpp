// Lesson 11: what only the composition needs. Fill in the TODO(L11) regions; nd.h says what each
// function must do, README.md teaches it, and `make test-lesson11` checks it against one device.
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtc/todo.h"
#include "nd.h"

namespace dtc::l11 {

Reduction gradient_reduction(const Mesh& mesh) {
  // TODO(L11)
  DTC_TODO("L11",
           "return the group (mesh dims) and divisor after which every rank holds the "
           "single device's gradient of the global batch's mean loss, or its tp slice; write "
           "norm_dims "
           "too, which make_groups needs (L11Groups.*, L11OneStep.*; README section 3)");
}

void sync_tied_embedding(RankModel& model, Comm* embedding) {
  if (!model.tied) return;
  // TODO(L11)
  DTC_TODO("L11",
           "make both copies' gradients (wte.weight on the first stage, lm_head.weight on "
           "the last) the sum of the two, with `embedding` or, pp 1, on this rank "
           "(L11OneStep.*_tied; README section 4)");
}

std::vector<std::string> norm_dims(const Mesh& mesh, int zero_stage) {
  (void)mesh;
  (void)zero_stage;
  // TODO(L11)
  DTC_TODO("L11",
           "return the dims of a group whose ranks together hold every parameter (or its "
           "slices), and no two of them the same reduced gradient unless they must "
           "(L11Groups.*, L11Clip.*; README section 5)");
}

double global_grad_norm(const RankModel& model, Comm& norm, double norm_type) {
  const bool inf = std::isinf(norm_type) && norm_type > 0;
  if (!inf && norm_type != 2) {
    throw std::invalid_argument(
        fmt::format("global_grad_norm: norm type {} (2 or inf)", norm_type));
  }
  // TODO(L11)
  DTC_TODO("L11",
           "return the whole model's gradient norm (2 or inf) as clip_grad_norm_ on one "
           "device computes it, each parameter counted once, the same on every rank of `norm` "
           "(L11Clip.*, L11ClipInf.*; README section 5)");
}

double clip_grad_norm(RankModel& model, Comm& norm, double max_norm, double norm_type) {
  const double total = global_grad_norm(model, norm, norm_type);
  // TODO(L11)
  DTC_TODO("L11",
           "when max_norm / (total + 1e-6) is below 1, every gradient this rank holds "
           "multiplied by it, as clip_grad_norm_ does on one device (L11Clip.*, L11ClipAbove.*; "
           "README section 5)");
  return total;
}

void sync_sequence_parallel(RankModel& model, Comm& tp) {
  if (!model.sequence_parallel || tp.getSize() == 1) return;
  // TODO(L11)
  DTC_TODO("L11",
           "sum over tp the gradients of the parameters each tp rank computed from its "
           "own rows of the sequence, and only those (L11OneStep.*_sp_*; README section 5b)");
}

}  // namespace dtc::l11
// generated from solutions/11_nd_parallel/nd.cpp; checksum be6e3ed9a261397f
