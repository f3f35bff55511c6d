// Lesson 09 contract: pipeline parallelism.
//
// The course's GPT (dtc/model.h, untied output head) is cut into p stages along its layers;
// stage s runs on rank s. Activations go forward from stage s to s + 1 with send/recv, their
// gradients come back from s + 1 to s, and a batch is cut into m micro-batches so that stages
// work at the same time. A schedule decides in which order a stage runs its micro-batches:
// GPipe (all forwards, then all backwards; Huang et al. 2019), 1F1B (one forward, one backward;
// PipeDream-Flush, Narayanan et al. 2021, as in Megatron-LM), interleaved 1F1B (v model chunks
// per rank; Narayanan et al. 2021) and ZB-H1 (the backward split into the input's gradient and
// the weights'; Qi et al. 2024). This header is the whole specification of what you implement
// in pipeline.cpp; README.md beside it teaches it.
//
//   make test-lesson09        # your exercise, test by test
//   make run-lesson09 NPROC=4 ARGS="--micro-batches 4 --schedule 1f1b"
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dtc/compat.h"
#include "dtc/data.h"
#include "dtc/dist.h"
#include "dtc/model.h"

namespace dtc::l09 {

// ---------------------------------------------------------------------------------------------
// The split (you implement stage_layers and make_stage)
// ---------------------------------------------------------------------------------------------

/// The layers one stage owns: blocks [first, last) of the model, and the ends of the model.
struct StageLayers {
  int64_t first = 0;   ///< first transformer block of the stage
  int64_t last = 0;    ///< one past its last block
  bool embed = false;  ///< stage 0: holds wte and wpe, and reads the tokens
  bool head = false;   ///< the last stage: holds ln_f and lm_head, and computes the loss
  int64_t count() const { return last - first; }
};

/// The blocks of stage @p stage out of @p stages, for a model of @p layers blocks.
///
/// The rule: as even as possible, the remainder to the first stages. Every stage gets
/// layers / stages blocks, and the first layers % stages stages one more; stages are
/// contiguous and in order (stage 0 starts at block 0, the last ends at block layers).
/// E.g. 5 layers on 2 stages: [0, 3) and [3, 5). embed is true for stage 0, head for stage
/// stages - 1 (both for a single stage).
/// Precondition: 1 <= stages <= layers and 0 <= stage < stages (check_pipeline() checks them).
StageLayers stage_layers(int64_t layers, int stages, int stage);

/// What the given Stage::forward() sees of each backward pass through a micro-batch's graph,
/// from outside the executor (a hook on the stage's output, where the pass starts, and the
/// autograd engine's end-of-pass callback): whether the pass computed the stage's weight
/// gradients (a whole backward B, or a W) or only its input's gradient (an I). The trace's
/// B/I/W spans and the program's data-parallel averaging (PipelineOptions::replicas) build on it.
/// Given; one per Stage, shared by its copies.
struct BackwardWatch {
  std::mutex mu;
  int64_t micro_batches = 0;              ///< m of this step (Stage::begin_step)
  int64_t weights_done = 0;               ///< micro-batches whose weight gradients are in
  std::function<void()> on_weights_done;  ///< runs once all m are in (Stage::begin_step)
  std::set<int64_t> input_only;           ///< micro-batches whose input gradient came alone (I)
};

/// One stage of the pipeline: the modules it owns (the others are nullptr / absent).
struct Stage {
  GptConfig config;
  int stage = 0;   ///< this stage's index, 0 .. stages - 1
  int stages = 1;  ///< p
  StageLayers layers;
  torch::nn::Embedding wte{nullptr};   ///< stage 0 only
  torch::nn::Embedding wpe{nullptr};   ///< stage 0 only
  std::vector<Block> blocks;           ///< model blocks layers.first .. layers.last - 1
  torch::nn::LayerNorm ln_f{nullptr};  ///< last stage only
  torch::nn::Linear lm_head{nullptr};  ///< last stage only
  /// The dtype the stage computes in (train_pipeline sets bf16 once MasterAdamW has cast the
  /// parameters); make_stage leaves it fp32.
  Precision precision = Precision::kFp32;
  /// Stage 0: the global positions of the tokens it is given (T, int64), for a pipeline whose
  /// ranks see part of each sequence (context parallelism, lesson 11); undefined (make_stage's
  /// default): 0, 1, ..., T-1.
  torch::Tensor positions;
  /// Applied to the activations just before the stage's first block and just after its last
  /// (undefined, make_stage's default: nothing). Lesson 11's sequence parallelism: each tp rank's
  /// rows of the sequence in, the whole sequence gathered out, so that the messages between
  /// stages keep their (b, T, h) shape.
  std::function<torch::Tensor(const torch::Tensor&)> enter_blocks, leave_blocks;
  /// Called at the end of every forward() that builds a graph, once its output exists (undefined,
  /// make_stage's default: nothing). An observer for measurements from outside the executor:
  /// lesson 11 reads the counting allocator there.
  std::function<void()> after_forward;

  /// Every parameter this stage owns, in the model's order (what its optimizer updates).
  std::vector<torch::Tensor> parameters() const;

  /// This stage's part of the model's forward (given, in pipeline_given.cpp):
  ///   stage 0:  tokens (b, T) int64 -> wte(tokens) + wpe(0..T-1) -> its blocks
  ///   others:   activations (b, T, h) -> its blocks
  ///   last:     ... -> ln_f -> lm_head -> logits (b, T, V)
  /// Between stages the activations are fp32 tensors whatever the precision: in bf16 a stage
  /// casts its input to bf16 and its output back to fp32 (exact: the bf16 values, so the
  /// executor's fp32 messages carry them unchanged, at 4 bytes an element instead of 2), and the
  /// logits are fp32 for the loss.
  torch::Tensor forward(const torch::Tensor& input);

  /// A trace's micro-batch labels (F{k}, R{k}, B{k}, I{k}, W{k}; see forward()) start again
  /// from 0: the program calls it before each run_schedule. With @p micro_batches m > 0,
  /// @p on_weights_done runs once the weight gradients of all m micro-batches are in (at the end
  /// of the backward pass that completes them, from inside the executor's autograd call).
  void begin_step(int64_t micro_batches = 0, std::function<void()> on_weights_done = {});
  int64_t traced_forwards = 0;        ///< forward calls with a graph, or without (recompute)
  int64_t traced_recomputes = 0;      ///< calls with a graph after one without, this step
  bool traced_without_graph = false;  ///< a call of this step ran without a graph
  int chunk = 0;   ///< which of the rank's chunks this is (make_chunks sets it; given)
  int chunks = 1;  ///< of how many: with more than one, trace labels carry it first ("1F3")
  std::shared_ptr<BackwardWatch> watch = std::make_shared<BackwardWatch>();  ///< given
};

/// Stage @p stage of @p stages, cut out of @p full: the same module objects (not copies), so
/// the stage starts from exactly the weights of @p full (build it with dtc::init_weights for the
/// baseline's weights). Take stage_layers()' blocks from full->h, and wte, wpe (stage 0) and
/// ln_f, lm_head (last stage) from @p full; leave the others null.
/// @throws dtc::UsageError from check_pipeline() (stages vs layers), or when @p full is tied
///   ("--untied": pipelines here need the separate output head).
Stage make_stage(const Gpt& full, int stages, int stage);

/// Rank @p rank's @p chunks model chunks of a pipeline of @p stages ranks, cut out of @p full
/// with make_stage(): chunk c is virtual stage c stages + rank of the stages x chunks that cut
/// the model (one chunk: the rank's stage); each knows its chunk and chunks. Given.
std::vector<Stage> make_chunks(const Gpt& full, int stages, int chunks, int rank);

/// Every parameter of @p chunks, chunk by chunk (what the rank's optimizer steps). Given.
std::vector<torch::Tensor> parameters_of(const std::vector<Stage>& chunks);

// ---------------------------------------------------------------------------------------------
// Checks (given)
// ---------------------------------------------------------------------------------------------

/// Checks a pipeline: 1 <= stages <= layers, and micro_batches >= 1 dividing @p batch.
/// @throws dtc::UsageError naming --stages ("more stages than layers") or --micro-batches
///   ("does not divide the batch"), with the fix in the hint.
void check_pipeline(const GptConfig& config, int stages, int64_t batch, int64_t micro_batches);

// ---------------------------------------------------------------------------------------------
// Schedules (you implement them): a pure function of (p, m, stage)
// ---------------------------------------------------------------------------------------------

/// One step of a schedule: micro-batch `micro`'s forward or backward on model chunk `chunk`
/// of this rank (0 unless the schedule is interleaved).
struct Op {
  /// kForward (F) and kBackward (B, the whole backward); zero-bubble schedules split B into
  /// kInput (I: only the gradient of the stage's input, which the stage before waits for; the
  /// graph is kept) and kWeight (W: the weight gradients from that graph, which nobody waits for).
  enum Kind { kForward, kBackward, kInput, kWeight } kind = kForward;
  int64_t micro = 0;
  int chunk = 0;
  bool operator==(const Op& o) const {
    return kind == o.kind && micro == o.micro && chunk == o.chunk;
  }
};

/// Which schedule.
enum class ScheduleKind { kGpipe, k1f1b, kInterleaved, kZbH1 };

/// "gpipe", "1f1b", "interleaved" or "zb-h1" -> ScheduleKind. @throws
/// dtc::UsageError("--schedule") otherwise. Given.
ScheduleKind parse_schedule(const std::string& name);
/// ScheduleKind -> "gpipe", "1f1b", "interleaved" or "zb-h1". Given.
const char* schedule_name(ScheduleKind kind);

/// GPipe (Huang et al. 2019): F0 F1 ... F(m-1), then B0 B1 ... B(m-1), on every stage (the
/// backward order of Narayanan et al. 2021, Figure 3, and of PyTorch's ScheduleGPipe).
std::vector<Op> gpipe_schedule(int stages, int64_t micro_batches, int stage);

/// 1F1B (PipeDream-Flush, Narayanan et al. 2021, Figure 4; Megatron-LM's
/// forward_backward_pipelining_without_interleaving) for stage @p stage of @p stages: each
/// micro-batch's forward and backward exactly once, forwards and backwards each in micro-batch
/// order; a warm-up of forwards, then one forward and one backward in turn, then the backwards
/// left. The warm-up is as short as it can be without the stage ever waiting for a gradient
/// that the stages after it cannot have sent yet, so a stage never holds more micro-batches
/// than it must (README section 3 has Figure 4's orders; section 6, hints).
std::vector<Op> one_f_one_b_schedule(int stages, int64_t micro_batches, int stage);

/// Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, section 2.2.2 and Figure 4, bottom;
/// forward_backward_pipelining_with_interleaving in megatron/core/pipeline_parallel/
/// schedules.py) for rank @p stage of @p stages, holding @p chunks (v) model chunks: chunk c is
/// virtual stage c p + stage of the p v that cut the model (rank 0 holds 0, p, 2p, ...). Every
/// (chunk, micro-batch) has one forward and one backward. The k-th forward (k = 0 .. v m - 1)
/// runs micro-batch (k / (p v)) p + k mod p on chunk (k mod p v) / p: p micro-batches go through
/// chunk 0, the same p through chunk 1, ..., then the next p; the k-th backward runs the same
/// micro-batch on chunk v - 1 - (k mod p v) / p. A warm-up of forwards, then one forward and one
/// backward in turn, then the backwards left. The warm-up lasts until the rank's first backward
/// (micro-batch 0 on chunk v - 1) can have its gradient: (v - 1) p forwards come before that
/// micro-batch's forward on chunk v - 1, and while it goes on to the last rank and its gradient
/// comes back, one slot per rank each way, the rank runs 2 (p - stage - 1) more forwards; at most
/// v m (README section 7 derives it).
/// Preconditions (check_interleaved()): chunks >= 2, micro_batches a multiple of stages.
std::vector<Op> interleaved_schedule(int stages, int64_t micro_batches, int stage, int chunks);

/// ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 2.1, Figure 3, top):
/// 1F1B with each backward split in two, I (kInput) where 1F1B runs B, and W (kWeight) later.
/// Forwards and I's in 1F1B's order (the same warm-up); the W of micro-batch j right after the I
/// of micro-batch j + stage (stage 0: right after its own I), so that every stage holds at most
/// p micro-batches' graphs, as 1F1B's first stage does, while W fills the time 1F1B spends
/// waiting in the cool-down; the W's left come last, in order.
std::vector<Op> zb_h1_schedule(int stages, int64_t micro_batches, int stage);

/// The schedule @p kind for (stages, micro_batches, stage), with @p chunks model chunks per rank
/// (interleaved; 1 for the others). Given.
std::vector<Op> make_schedule(ScheduleKind kind, int stages, int64_t micro_batches, int stage,
                              int chunks = 1);

/// Checks an interleaved pipeline: at least 2 chunks per rank (--virtual-stages; 1 is 1f1b), the
/// layers a multiple of stages x chunks (every chunk the same number of blocks, as Megatron
/// asks), micro-batches a multiple of the stages (Megatron's default group of p micro-batches).
/// @throws dtc::UsageError naming --virtual-stages or --micro-batches, with the fix. Given.
void check_interleaved(const GptConfig& config, int stages, int chunks, int64_t micro_batches);

/// "F0 F1 B0 B1" (given; for messages and the program's output); I and W for the split
/// backward; with chunks, each op as PyTorch's pipelining writes an action, the chunk first:
/// "0F0 0F1 1F0 ...".
std::string to_string(const std::vector<Op>& ops);

/// The largest number of micro-batches (of all chunks) whose forward is done and whose backward
/// is not (for a split backward: whose W is not), at any point of @p ops: the stored activations
/// a stage holds at its peak (GPipe: m; 1F1B: min(m, p - s); ZB-H1: min(m, p)). Given.
int64_t max_in_flight(const std::vector<Op>& ops);

// ---------------------------------------------------------------------------------------------
// Point-to-point (you implement them)
// ---------------------------------------------------------------------------------------------

/// The tag of micro-batch @p micro's activations (even) and of its gradients (odd) for the model
/// chunk @p chunk that receives them, so the two directions, the micro-batches and the chunks
/// never mix. Given.
inline int activation_tag(int64_t micro, int chunk = 0) {
  return static_cast<int>(2 * (micro + (int64_t{chunk} << 20)));
}
inline int gradient_tag(int64_t micro, int chunk = 0) { return activation_tag(micro, chunk) + 1; }

/// Starts sending @p tensor (contiguous) to rank @p dst with @p tag, as a group of one
/// (dtc::batch_isend_irecv, dtc/dist.h: on NCCL every message of the pipeline must travel the
/// same way, the communicator of the whole group; README section 2). Returns the work without
/// waiting: the executor waits for it later (a send may only complete once the receiver has
/// posted its receive, and the receiver may be busy).
c10::intrusive_ptr<c10d::Work> send_tensor(Comm& comm, const torch::Tensor& tensor, int dst,
                                           int tag);

/// Receives a float tensor of shape @p shape from rank @p src with @p tag into a fresh tensor on
/// @p device, as a group of one (dtc::batch_isend_irecv, as send_tensor), and waits for it. On
/// gloo the CPU waits until the message is there, and the communicator's timeout turns a missing
/// sender into an error; on NCCL wait() makes the current CUDA stream wait for the transfer (the
/// CPU goes on unless TORCH_NCCL_BLOCKING_WAIT=1), and c10d's watchdog aborts the process when
/// the transfer outlasts the timeout.
torch::Tensor recv_tensor(Comm& comm, at::IntArrayRef shape, int src, int tag,
                          const torch::Device& device = torch::kCPU);

/// Megatron's deallocate_output_tensor (megatron/core/pipeline_parallel/schedules.py): once a
/// stage has sent a forward's output to the next stage, it needs only the output's autograd
/// graph (grad_fn) for the backward, not its values: the output's data becomes a one-element
/// placeholder, and its (b/m, T, h) values are freed as soon as the send lets go of them. Valid
/// when the output's grad_fn does not save the output itself (a block ends with a residual
/// add, whose backward saves nothing). Given.
/// @throws std::invalid_argument, as Megatron's asserts, when @p output is a view (freeing it
///   would not free its base) or has no grad_fn.
void deallocate_output(torch::Tensor& output);

/// Runs backward from @p output's grad_fn with @p grad (the output's gradient, received),
/// straight through the autograd engine, which checks @p grad against the shape the grad_fn
/// recorded, never against the output's current data (one element after deallocate_output()).
/// Megatron's custom_backward: Python's torch.autograd.backward compares the two shapes and
/// would refuse; LibTorch's torch::autograd::backward does not compare them in 2.x, but going to
/// the engine does not depend on that. Given.
/// @throws std::invalid_argument when @p output has no grad_fn.
void backward_from_graph(const torch::Tensor& output, const torch::Tensor& grad);

// ---------------------------------------------------------------------------------------------
// The executor (you implement run_schedule)
// ---------------------------------------------------------------------------------------------

/// What one stage measured during one step.
struct StepStats {
  float loss = 0;             ///< last stage: sum over micro-batches of loss_i / m; else 0
  int64_t max_in_flight = 0;  ///< most micro-batches stored at once (forward done, backward not)
  double total_s = 0;         ///< seconds from the start of the step to the end of its last op
  double compute_s = 0;       ///< seconds spent in forward and backward compute
  /// Idle fraction (total - compute) / total: waiting for neighbours and moving data.
  double bubble() const { return total_s > 0 ? (total_s - compute_s) / total_s : 0.0; }
};

/// Runs @p ops on this rank's model @p chunks for one batch (one chunk per rank, or v with the
/// interleaved schedule: chunks[c] is virtual stage c p + rank, as make_chunks() cuts them),
/// accumulating gradients into the chunks' parameters (the caller zeroes them before and steps
/// the optimizer after). The communicator's rank is the rank's place in the
/// pipeline, its size p. Below, "stage" is the op's chunk, "stage - 1" the virtual stage before
/// it (on the rank before, and for chunk c > 0 on rank 0: the previous chunk on rank p - 1) and
/// "stage + 1" the one after; a message's tag names the chunk that receives it
/// (activation_tag(i, chunk), gradient_tag(i, chunk)).
///
/// @p batch is the whole batch of the step, (b, T) inputs and targets, on every stage, on the
/// device the stage computes on (received tensors go there too); micro-
/// batch i is rows [i b/m, (i+1) b/m). For each op:
///  - Forward i: stage 0 takes micro-batch i's inputs; another stage receives the activations
///    (b/m, T, h) from stage - 1 (tag activation_tag(i)) and sets requires_grad on them, to get
///    their gradient later. Run stage.forward. The last stage computes the micro-batch's mean
///    cross-entropy divided by m (so the gradients add up to the full batch's mean) and adds its
///    value to the loss; another stage sends its output to stage + 1 (not waiting). Keep the
///    input and the output of micro-batch i until its backward.
///  - Backward i: the last stage runs backward from its scaled loss; another stage receives the
///    output's gradient (b/m, T, h) from stage + 1 (tag gradient_tag(i)) and runs
///    torch::autograd::backward({output}, {grad}). A stage other than 0 sends its input's
///    gradient to stage - 1 (not waiting). Then drop micro-batch i's tensors.
/// Safe on NCCL (README section 2), under NCCL's rules: one communicator for every message (so
/// every send and receive is a dtc::batch_isend_irecv group, send_tensor and recv_tensor too);
/// each rank's groups run in order, and a group completes only when each of its ops has met its
/// peer's; the k-th message from one rank to another is the k-th receive posted there. No rank
/// may wait for its own send before its neighbour can receive it: in 1F1B's steady state a
/// forward's output goes to stage + 1 while the next backward's gradient comes from stage + 1
/// (and after a backward the other way round), so start such a send together with that receive,
/// as one group, and wait for the pair before the next op reads the message ("the next op": the
/// next that receives; a W neither receives nor sends, so ZB-H1's I pairs its send with the
/// forward after the W that follows it, where a send left alone would hold its gradient until
/// the step ends: L09Memory.ZbH1* measures it). With several
/// chunks that pairing can wait in a circle (the ring wraps around, and a rank's next receive may
/// need what its neighbour sends only after its own next exchange), so use Megatron's exchanges
/// there (forward_backward_pipelining_with_interleaving, without overlap_p2p_comm): after the
/// rank's warm-up of w forwards (the schedule's count), ops w, w + 1 are the first steady pair
/// (F, B), w + 2, w + 3 the next, and so on. A pair's forward holds its send for the pair's
/// exchange; after every other op, even one that sends nothing, one exchange: one group of the
/// sends held, the next op's receive and, when the next op is a pair's forward, its pair's
/// backward's receive too; wait for the group. L09NcclSafe.* replays the recorded calls under
/// these rules; L09Timeline.InterleavedExchangesKeepTheBubbleOfAChunk replays the step on a
/// clock where messages are free, and finds a bubble above (p - 1)/(v m + p - 1) (1F1B's, or
/// worse) when a group waits for a message the schedule does not need yet.
/// Wait for every send before returning. Fill StepStats: time compute (forward, loss,
/// backward) separately from the whole step, and count micro-batches in flight.
/// With @p deallocate_outputs, a stage other than the last frees each forward's output values
/// once its send has started (deallocate_output()) and runs that micro-batch's backward with
/// backward_from_graph(): a stage then holds, per micro-batch in flight, its layers' saved
/// tensors but not the (b/m, T, h) output it sent on. L09Memory.* measures the difference.
/// With @p recompute (full activation recomputation of the stage, Megatron's
/// --recompute-granularity full over the stage's layers), a forward records no graph
/// (c10::AutoGradMode off) and keeps only micro-batch i's input; its backward runs
/// stage.forward again from that input, with the graph, and backpropagates through it (the last
/// stage: through the micro-batch's loss). The gradients are the same bit for bit on the CPU;
/// a stage holds one (b/m, T, h) input per micro-batch in flight instead of its layers' saved
/// tensors. L09Recompute.* checks both; @p deallocate_outputs has nothing left to free then.
/// A split backward (ZB-H1): I i receives the gradient as a backward does, computes only the
/// input's gradient with the graph kept (torch::autograd::grad, retain_graph; the first stage's
/// input is the tokens: nothing to compute) and sends it as a backward does; W i runs the
/// backward from the same output and gradient into the chunk's parameters only (the `inputs`
/// argument of torch::autograd::backward), frees the graph and drops micro-batch i. It needs the
/// whole graph: with @p recompute or @p deallocate_outputs, std::invalid_argument.
StepStats run_schedule(std::vector<Stage>& chunks, Comm& comm, const std::vector<Op>& ops,
                       const Batch& batch, int64_t micro_batches, bool deallocate_outputs = false,
                       bool recompute = false);

/// run_schedule() on one stage per rank (GPipe, 1F1B, ZB-H1): the chunks {stage}. Given.
StepStats run_schedule(Stage& stage, Comm& comm, const std::vector<Op>& ops, const Batch& batch,
                       int64_t micro_batches, bool deallocate_outputs = false,
                       bool recompute = false);

// ---------------------------------------------------------------------------------------------
// Data parallelism over pipelines, and names (given, in pipeline_given.cpp)
// ---------------------------------------------------------------------------------------------

/// dp x pp: each chunk's gradients summed with the same chunk of the other replicas, one fp32
/// allreduce per chunk over @p replicas, started by the chunk's watch (Stage::begin_step) when
/// its last micro-batch's weight gradients are in, inside the executor's step, so that it runs
/// while the stages before are still in their cool-down. Build one per step, before
/// run_schedule (it calls begin_step on every chunk); finish() after it.
class ReplicaAverage {
 public:
  /// @param chunks this rank's chunks (begin_step is called on each)
  /// @param replicas the chunk's replicas (null or of size 1: nothing to reduce)
  /// @param micro_batches m of the step (each chunk's reduction starts once all m are in)
  /// @param divisor what the sums are divided by; 0: the replicas' size (their mean)
  ReplicaAverage(std::vector<Stage>& chunks, Comm* replicas, int64_t micro_batches,
                 double divisor = 0);
  /// The chunks' watches must not call back into an average that is gone.
  ~ReplicaAverage();
  ReplicaAverage(const ReplicaAverage&) = delete;
  ReplicaAverage& operator=(const ReplicaAverage&) = delete;
  /// After the step: waits for each chunk's allreduce and writes sum / divisor into the
  /// gradients (with no replicas to sum over: the gradients / divisor).
  /// @throws std::runtime_error when a chunk's weight gradients were never all in
  void finish();

 private:
  void start(size_t c);
  std::vector<Stage>& chunks_;
  Comm* replicas_;
  double divisor_;
  std::vector<torch::Tensor> flats_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

/// @p stage's parameters under the full model's names (its blocks are the model's h.<i>), in
/// Stage::parameters() order: what param_digest and the tests match.
std::vector<std::pair<std::string, torch::Tensor>> stage_pieces(const Stage& stage);

}  // namespace dtc::l09
