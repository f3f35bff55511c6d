// Lesson 01, part 2: the five parallelism strategies, and choosing a mix. Implements
// lessons/01_memory_ledger/strategy.h.
//
// Fill in every TODO(L01) below, top to bottom; `make test-lesson01` checks the collectives
// against nccl-tests' factors, the traffic against closed forms, and your plans against
// published set-ups (Megatron's GPT-3 175B, Llama 3 405B, a 7B model on one node).
// The cluster presets, the candidate mixes, the reasons and the plan around your decision tree are
// given, in strategy_given.cpp.
#include "strategy.h"

#include <optional>

#include "dtc/todo.h"

namespace dtc::l01 {

namespace {

constexpr double kGB = 1e9;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Traffic, links and the ledger of a mix (your part)
// ---------------------------------------------------------------------------------------------

double collective_bytes(Collective c, double bytes, int64_t n) {
  // TODO(L01)
  DTC_TODO("L01",
           "return what each of n ranks sends: the array's bytes times its collective's "
           "bus-bandwidth factor (strategy.h); a group of one sends nothing, but send/recv "
           "always "
           "sends its array. Tests: L01Collectives.*");
}

double step_bytes_per_gpu(Strategy s, const PlanRequest& req, const Mix& mix) {
  // TODO(L01)
  DTC_TODO("L01",
           "return README's \"one formula per strategy\" for s in this mix, every term a "
           "collective_bytes() (a group of degree 1 sends nothing). Tests: L01Traffic.*; hints: "
           "README part 2, \"The exercise\"");
}

bool crosses_nodes(Strategy s, const Mix& mix, int64_t gpus_per_node) {
  // TODO(L01)
  DTC_TODO("L01",
           "return whether the group of s spans more than one node under the rank order "
           "tp, cp, pp, dp; the data-parallel flavours cross when their dp or cp group does. "
           "Tests: L01Links.*; hints: README part 2, \"The exercise\"");
}
Ledger mix_ledger(const PlanRequest& req, const Mix& mix) {
  // TODO(L01)
  DTC_TODO("L01",
           "return part 1's ledger of this mix as strategy.h specifies it: ZeRO over "
           "dp * cp, sequence parallel with tp, activations per cp, ZeRO-3's gathered layer on "
           "top. "
           "Tests: L01MixLedger.*; hints: README part 2, \"The exercise\"");
}

Evaluation evaluate(const PlanRequest& req, const Mix& mix) {
  Evaluation e;
  e.mix = mix;
  // TODO(L01)
  DTC_TODO("L01",
           "fill every other field of e as Evaluation documents it (traffic: one entry "
           "per group of degree > 1, in the order dp, tp, pp, cp, ep; step = compute x (1 + "
           "bubble) "
           "+ comm). Tests: L01Evaluate.*; hints: README part 2, \"The exercise\"");
  return e;
}

// ---------------------------------------------------------------------------------------------
// The decision tree (your part)
// ---------------------------------------------------------------------------------------------

namespace {

const Family kFamilies[] = {Family::kDdp, Family::kZero, Family::kTensor, Family::kPipeline,
                            Family::kContext};

}  // namespace

Plan choose_mix(const PlanRequest& req) {
  Plan p;
  // TODO(L01)
  DTC_TODO("L01",
           "fill p.branches (each family's fastest fitting, fed candidate), then "
           "p.eval, p.family and p.reasons with the fastest of them, a later branch only when it "
           "is "
           "more than kSimplerWithin faster (strategy.h); or the least-memory candidate when "
           "nothing "
           "fits. Tests: L01Plan.*; hints: README part 2, \"The exercise\"");
  return p;
}

}  // namespace dtc::l01
// generated from solutions/01_memory_ledger/strategy.cpp; checksum c9ae486930b3e8e9
