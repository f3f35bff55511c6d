// Lesson 11 contract: N-D parallelism, the strategies of lessons 08, 09 and 10 composed on one
// mesh, and what only their composition needs.
//
// A run is a mix, the planner's grammar (dtc/mix.h, lesson 01's --compare): DPxTPxPPxCP, each
// rank at one point of a dtc::Mesh (dtc/mesh.h) in torchtitan's order, pp slowest, tp fastest:
//
//   rank = tp_rank + tp (cp_rank + cp (dp_rank + dp pp_rank))
//
// With ZeRO (`--mix 2x2x2x1:1`, lesson 07's stages 1-3) the dp dimension is dp_shard instead of
// dp_replicate: the gradients are reduce-scattered over dp x cp, each rank keeps AdamW's moments
// of its shard of every parameter, and the updated shards are all-gathered (given: ShardedReduce
// and ShardedAdamW). Stage 1 is Megatron's distributed optimizer; stage 2 also keeps only its
// shard of the gradients between steps; stage 3 (FSDP) also its shard of the parameters,
// gathered whole at the start of a step and kept for all its micro-batches (torchtitan's FSDP
// under a pipeline: reshard_after_forward off). HSDP (`--mix 4x2x1x1:hsdp2`, FSDP's
// HYBRID_SHARD) is ZeRO-3 over groups of N dp ranks, dp_shard = N, replicated across the
// dp / N groups of dp_replicate: reduce-scatter within a group, then an allreduce of the shards
// across the groups (cp 1: dtc::check_mix refuses HSDP with cp, as lesson 01's planner does).
//
// Every rank builds the course's GPT, swaps each block's attention and MLP for lesson 08's
// tensor-parallel ones over its tp group (and, with cp, lesson 10's context-parallel attention
// over its cp group), and keeps the model chunks lesson 09 cuts for its pipeline stage (one, or
// v interleaved). Lesson 09's executor runs the schedule over the pp group, with the blocks' TP
// and CP collectives inside; the dp replicas each take their rows of the batch, the cp ranks
// their tokens of each row. What is left is what no lesson needed alone, and it is yours
// (nd.cpp):
//
//   1. gradient_reduction(): over which ranks the gradients of one parameter are summed after
//      the pipeline's backward, and what the sum is divided by, so that the loss is normalised
//      once over the global batch whatever dp, cp, tp and pp are;
//   2. sync_tied_embedding(): the tied embedding, held twice (wte on the first stage, its copy
//      as the head on the last), its two gradients summed (Megatron's embedding group);
//   3. norm_dims() and global_grad_norm(): the global gradient norm, 2-norm and inf-norm,
//      counting every parameter of the model exactly once;
//   4. clip_grad_norm(): the clipping every rank then applies, the same coefficient everywhere;
//   5. sync_sequence_parallel(): with sequence parallelism (--sequence-parallel), the gradients
//      that each tp rank computed from its own rows of the sequence, summed over tp.
//
// What must hold: after any number of steps, every rank's parameters are the single-device
// run's (lesson 02's model and AdamW, clip_grad_norm_ when clipping), within fp32 rounding (in
// bf16, --precision bf16, within the course's bf16 policy of that run's master weights).
// README.md beside it teaches it; tests/lesson11/ checks it.
//
//   make test-lesson11
//   make run-lesson11 NPROC=8 ARGS="--mix 2x2x2x1"
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "context_parallel.h"
#include "dtc/data.h"
#include "dtc/dist.h"
#include "dtc/mesh.h"
#include "dtc/mix.h"
#include "dtc/model.h"
#include "dtc/observe.h"
#include "dtc/program.h"
#include "pipeline.h"

namespace dtc::l11 {

// ---------------------------------------------------------------------------------------------
// The rank's model and groups (given, in nd_given.cpp)
// ---------------------------------------------------------------------------------------------

/// What this rank holds of the model.
struct RankModel {
  /// This rank's model chunks (lesson 09's stages: one, or v with the interleaved schedule),
  /// their blocks lesson 08's TpAttention and TpMlp when tp > 1.
  std::vector<l09::Stage> chunks;
  /// The tied embedding (GPT-2's, the course's default): the first stage's wte.weight and the
  /// last stage's lm_head.weight are two copies of one (V, h) matrix, equal at the start. Their
  /// gradients summed (sync_tied_embedding) and the same AdamW step keep them equal.
  bool tied = true;
  /// Megatron's sequence parallelism over tp (lesson 10's part 5): inside each chunk, from its
  /// first block to its last, the residual stream, the LayerNorms and the row-parallel biases
  /// hold this tp rank's rows of the sequence (T / tp of them); the chunk's input is split into
  /// them and its output gathered back, so the embeddings, ln_f and the head see every row.
  bool sequence_parallel = false;
  int tp_rank = 0;  ///< this rank's place in its tp group
  int tp = 1;       ///< the tp group's size
};

/// Whether the parameter called @p name (the full model's name, "h.3.mlp.c_fc.weight") is split
/// over the tp ranks when tp > 1, each holding a slice (lesson 08: c_attn's weight and bias,
/// c_fc's weight and bias, both c_proj weights), or held whole by every tp rank (the
/// embeddings, the LayerNorms, the row-parallel c_proj biases, ln_f, the head). The answer
/// depends on the name alone: with tp 1 the one "slice" is the whole.
bool tp_sharded(const std::string& name);

/// This rank's communicators over the mesh, built once per job by make_groups(), every rank
/// building its groups in the same order.
struct NdGroups {
  Mesh mesh;
  int rank = 0;
  int zero_stage = 0;           ///< the mix's: 0, or 1-3 (ZeRO over `reduce`)
  c10::intrusive_ptr<Comm> pp;  ///< the pipeline this rank is a stage of; its rank = stage
  c10::intrusive_ptr<Comm> tp;  ///< the tp group (a group of one when tp is 1)
  c10::intrusive_ptr<Comm> dp;  ///< the dp replicas of this rank (the step's loss)
  c10::intrusive_ptr<Comm> cp;  ///< the cp group: the ranks that split each sequence
  /// over gradient_reduction(mesh).dims; under ZeRO, over those of them that shard (dp_shard
  /// and cp): its reduce-scatter's and all-gather's group
  c10::intrusive_ptr<Comm> reduce;
  /// under ZeRO, over the rest of gradient_reduction(mesh).dims (dp_replicate: HSDP's groups of
  /// replicas, which allreduce their shards); a group of one otherwise
  c10::intrusive_ptr<Comm> replicate;
  c10::intrusive_ptr<Comm> norm;  ///< over norm_dims(mesh)
  /// The first and the last stage of this rank's pipeline (the same dp, cp and tp coordinates):
  /// Megatron's embedding group. Null on the other stages, and when pp is 1 (then one rank
  /// holds both copies).
  c10::intrusive_ptr<Comm> embedding;
  /// Every communicator above is one of these, which records each call on its way through:
  /// under the traffic's name ("dp" for dp and reduce, as the planner costs the gradient
  /// reduction over dp x cp; "tp", "pp", "cp", "embedding", "norm").
  std::vector<std::pair<std::string, c10::intrusive_ptr<RecordingComm>>> recorders;
};

/// The mesh of @p mix on @p world ranks: pp, dp_replicate, dp_shard, cp, tp (dp is dp_replicate
/// without ZeRO, dp_shard with it, and dp / N x N under HSDP N).
/// @throws UsageError("--mix") when the degrees do not multiply to @p world.
Mesh make_mesh(const MixSpec& mix, int world);

/// This rank's groups (the learner's gradient_reduction() and norm_dims() choose two of them;
/// @p zero_stage is the mix's, which norm_dims() is given). With a @p tracer (--trace), each
/// group's collectives and messages are spans of the trace too, named by their traffic.
NdGroups make_groups(const c10::intrusive_ptr<c10d::Store>& store, const Mesh& mesh, int rank,
                     int zero_stage, BackendKind backend, std::chrono::milliseconds timeout,
                     const std::string& master_addr = "127.0.0.1",
                     const std::shared_ptr<Tracer>& tracer = nullptr);

// ---------------------------------------------------------------------------------------------
// What you implement (nd.cpp)
// ---------------------------------------------------------------------------------------------

/// Which gradients are summed over which ranks after the pipeline's backward, and by what the
/// sum is divided.
struct Reduction {
  std::vector<std::string> dims;  ///< the mesh dimensions of the group (names of Mesh::order())
  int64_t divisor = 1;            ///< the sum over the group is divided by this
};

/// @brief The reduction that turns every rank's gradients into the single-device gradient of
///   the global batch's mean loss (or, for a tp shard, its slice).
///
/// Lesson 09's executor leaves on each rank the gradient of its pipeline's mean loss over the
/// tokens it saw: its dp replica's rows, and of each row its cp rank's tokens. The group is the
/// ranks that hold the same piece of the same parameter and saw other tokens; every other rank
/// holds another piece (tp) or another parameter (pp). Divide once, by the number of equal parts
/// the batch's tokens were cut into for that group. The dp dimension is dp_replicate, or
/// dp_shard under ZeRO (the other one then has size 1); the given code sums over the group with
/// an allreduce, or under ZeRO a reduce-scatter.
Reduction gradient_reduction(const Mesh& mesh);

/// @brief The tied embedding: after the step's reduction, make the first stage's wte.weight
///   gradient and the last stage's lm_head.weight gradient both the sum of the two.
///
/// @p model's chunks hold wte (the chunk whose layers.embed is set) and/or the head (layers.head)
/// of this rank's pipeline. With @p embedding (the two stages' group), sum over it; without
/// (pp 1), this rank holds both: add them here. A rank that holds neither does nothing. Untied
/// models (model.tied false) are left as they are.
void sync_tied_embedding(RankModel& model, Comm* embedding);

/// @brief The mesh dimensions of the group a global gradient norm is reduced over: together, its
///   ranks hold every parameter of the model (every tp slice of a split one), and none of them
///   holds a copy that only the reduction made (another replica's, another cp rank's). The copies
///   the model itself holds (a tp-whole parameter on every tp rank, the tied head) are in the
/// group: global_grad_norm() leaves them out of the count. With @p zero_stage 1-3 the reduction
/// is a reduce-scatter over dp_shard x cp: after it, each rank of that group holds only its shard
/// of every gradient (zeros elsewhere, ShardedReduce), and no two of them the same; under HSDP
/// the shards are then allreduced over dp_replicate, whose ranks hold the same ones.
std::vector<std::string> norm_dims(const Mesh& mesh, int zero_stage);

/// @brief The global gradient norm of the whole model, as torch::nn::utils::clip_grad_norm_
///   computes it on one device: the 2-norm (@p norm_type 2) or the largest magnitude (inf), of
///   every parameter's gradient, each parameter counted exactly once.
///
/// Runs after gradient_reduction() and sync_tied_embedding(). Every rank of @p norm (the group of
/// norm_dims()) calls it and gets the same value, from one collective over @p norm (the program
/// counts its bytes: one allreduce of one double, 8 bytes, however many parameters). Find each
/// gradient's full-model name with l09::stage_pieces(); tp_sharded() says whether this rank holds
/// a slice or the whole; with a tied model, the head's lm_head.weight is the copy of wte.weight.
/// @throws std::invalid_argument for a @p norm_type other than 2 or inf
double global_grad_norm(const RankModel& model, Comm& norm, double norm_type);

/// @brief torch::nn::utils::clip_grad_norm_ over the whole model: the global norm
///   (global_grad_norm()), then every gradient this rank holds multiplied by max_norm / (norm +
///   1e-6) when that is below 1. @return the norm before clipping.
double clip_grad_norm(RankModel& model, Comm& norm, double max_norm, double norm_type);

/// @brief With sequence parallelism (model.sequence_parallel and tp > 1), make the gradient of
///   every parameter that each tp rank holds whole but computed from its own rows of the
///   sequence the sum over @p tp of the ranks' gradients (Megatron's allreduce of the
///   sequence-parallel parameters' gradients); leave every other gradient as it is. Without
///   sequence parallelism, or with tp 1, does nothing.
///
/// Runs after gradient_reduction()'s sum and before sync_tied_embedding(). Which parameters:
/// those a block holds whole (tp_sharded() false) sit in the rows of the sequence; a tp slice
/// saw every row through its collectives, and the embeddings, ln_f and the head sit outside the
/// blocks (RankModel::sequence_parallel), so each already holds the whole gradient.
void sync_sequence_parallel(RankModel& model, Comm& tp);

// ---------------------------------------------------------------------------------------------
// The step and the run (given, in nd_given.cpp)
// ---------------------------------------------------------------------------------------------

/// Everything that decides a run: lesson 02's (dtc::RunConfig), the mix, and the step's own.
struct NdOptions : RunConfig {
  MixSpec mix;                                            ///< --mix (its VIRTUAL: --virtual-stages)
  l09::ScheduleKind schedule = l09::ScheduleKind::k1f1b;  ///< --schedule (interleaved when v > 1)
  int64_t steps = 20;                                     ///< --steps
  double clip = 0;                                        ///< --clip: the max norm; 0 off
  double norm_type = 2;                                   ///< --norm-type 2 or inf
  l10::Attention attention = l10::Attention::kRing;       ///< --attention, with cp above 1
  bool zigzag = false;             ///< --zigzag: lesson 10's balanced split of each sequence
  bool sequence_parallel = false;  ///< --sequence-parallel: Megatron's, over tp (RankModel)
  torch::Device device = torch::kCPU;
  bool digest = false;  ///< train_nd fills NdResult::digest
};

/// What the mix needs of the model and the batch, checked on every rank before any networking.
/// @throws UsageError naming --mix (dtc::check_mix's rules, and what this lesson does not compose
///   yet: selective recomputation), --schedule (zb-h1 or gpipe with virtual
///   stages, zb-h1 with recomputation), --clip (negative), --sequence-parallel (tp 1, zb-h1,
///   or what lesson 10's validate_sequence_parallel names: --seq), or what lesson 10's
///   validate_cp names for cp (--seq, --heads, --cp, --zigzag) on the heads a tp rank holds.
void check_nd(const NdOptions& options, int world);

/// The micro-batches each pipeline cuts its rows into: batch / (dp x MICRO).
int64_t micro_batches(const NdOptions& options);

/// This rank's model, from the baseline's initial weights (dtc::init_weights with the seed):
/// the untied GPT, whose lm_head.weight is then set to wte.weight when options.tied, its blocks
/// split over @p groups.tp, their attention over @p groups.cp (lesson 10's), cut into this rank's
/// chunks; the first stage's chunk gets its cp rank's token positions.
RankModel build_rank_model(const NdOptions& options, const NdGroups& groups);

/// ZeRO's shards (given): every parameter a rank holds, flattened and padded to a multiple of
/// n (the reduce group's size), is cut into n equal chunks, and rank r of the group owns chunk
/// r, as FSDP2 shards each parameter on its own (not one flat buffer, where the tied embedding's
/// two copies would land in different shards: Megatron-LM#844).
struct ShardRange {
  int64_t chunk = 0;  ///< ceil(numel / n): the padded chunk
  int64_t begin = 0;  ///< r chunk, the first owned element of the flattened parameter
  int64_t size = 0;   ///< owned elements: chunk, less past the end (0 for a rank past it)
};
ShardRange shard_range(int64_t numel, int n, int r);

/// ZeRO's gradient reduction (given), lesson 09's ReplicaAverage with a reduce-scatter: each
/// chunk's starts when its last backward is done (overlapping the cool-down), over @p group, in
/// fp32 (lesson 07's reduce-scatter from an all-to-all, which every gloo has). finish() sums the
/// shards over @p replicate when it has more than one rank (HSDP), and writes into each gradient
/// the sum over its own shard, divided by @p divisor, and zeros elsewhere.
class ShardedReduce {
 public:
  ShardedReduce(std::vector<l09::Stage>& chunks, Comm* group, Comm* replicate,
                int64_t micro_batches, double divisor);
  ~ShardedReduce();
  ShardedReduce(const ShardedReduce&) = delete;
  ShardedReduce& operator=(const ShardedReduce&) = delete;
  /// @throws std::runtime_error when a chunk's weight gradients were never all in
  void finish();

 private:
  void start(size_t c);
  std::vector<l09::Stage>& chunks_;
  Comm* group_;
  Comm* replicate_;
  double divisor_;
  std::vector<torch::Tensor> received_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

/// ZeRO's optimizer (given): torch::optim::AdamW over this rank's shards of @p params (fp32
/// copies, the only ones with moments), and one all-gather over @p group per step that puts every
/// updated shard into every rank's parameters. AdamW is elementwise: the shards' steps are the
/// whole tensors' step. What each stage keeps between steps (after step()):
///   - 1: the whole parameters and gradients, and the shards' copies with their gradients;
///   - 2: the whole parameters, the shards' copies and their gradients (the whole gradients
///     released: a step's backward makes them again);
///   - 3: the shards and their gradients only: the whole parameters' storage is freed
///     (dtc::free_storage) until gather() refills it at the start of the next step.
class ShardedAdamW {
 public:
  ShardedAdamW(std::vector<torch::Tensor> params, Comm* group,
               const torch::optim::AdamWOptions& options, int stage = 1);
  /// AdamW on the owned shards from the gradients' owned elements; then (stages 1 and 2) the
  /// all-gather, or (stage 3) the whole parameters freed. Stages 2 and 3 release the whole
  /// gradients.
  void step();
  /// Stage 3: the all-gather of every rank's shards into the whole parameters (a step's first
  /// forward needs them). Does nothing when they are already whole (stages 1 and 2, or before the
  /// first step).
  void gather();
  /// Stage 3: frees the whole parameters' storage (0 bytes; their shapes stay).
  void release();
  /// The elements of AdamW's two moments this rank keeps (2 x its owned elements).
  int64_t state_elements();
  /// Every parameter whole in fp32, from every rank's fp32 shards (one all-gather): in bf16 the
  /// master weights, which the parameters hold rounded.
  std::vector<torch::Tensor> gather_masters();
  /// The bytes of the shards' fp32 copies (first) and of their gradients (second): stage 3's
  /// parameters, and what stages 1 and 2 hold besides the whole parameters (Megatron's
  /// distributed optimizer keeps such a main-parameter shard for a 16-bit model; an fp32 model
  /// could update its parameters' own storage instead).
  std::pair<int64_t, int64_t> shard_bytes() const;
  /// This rank's fp32 shard of each parameter (undefined where it owns none), in the
  /// constructor's order: the tensors AdamW steps.
  const std::vector<torch::Tensor>& shards() const { return shards_; }
  /// The AdamW over shards() (null when this rank owns no element).
  torch::optim::AdamW* optimizer() { return adamw_.get(); }
  /// After shards() were written from outside (a checkpoint): every rank's shards all-gathered
  /// into the whole parameters (stages 1 and 2; stage 3 gathers them at the next step's start).
  void params_from_shards();

 private:
  // Every rank's shards into @p into (one tensor per parameter, its shape), in @p options.
  void all_gather_into(std::vector<torch::Tensor>& into, const torch::TensorOptions& options);
  void all_gather();
  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> shards_;  // one per parameter (empty where none is owned)
  Comm* group_;
  int stage_;
  bool released_ = false;
  std::unique_ptr<torch::optim::AdamW> adamw_;
};

/// What one step measured.
struct StepOut {
  float loss = 0;        ///< the global batch's mean loss (every rank)
  double grad_norm = 0;  ///< the global gradient norm before clipping (clip_grad_norm); 0 when
                         ///< not clipping
  /// What this rank's forwards hold when its first backward pass starts, in bytes: the storage
  /// this thread allocated since the schedule's start and still holds (the counting allocator's
  /// dtc::thread_cpu_memory_since_mark), read at the end of the last forward before it. -1 when
  /// not measured: the counting allocator is not installed, or --recompute full (whose forwards
  /// keep no graph).
  int64_t activation_bytes = -1;
};

/// One step's gradients, without the optimizer: zero them, run the schedule on this replica's
/// rows of batch @p step (this cp rank's tokens of each), the reduction (started during the
/// cool-down, lesson 09's ReplicaAverage with gradient_reduction()'s divisor; under ZeRO a
/// reduce-scatter), with sequence parallelism sync_sequence_parallel(), the tied embedding's
/// sync, and with options.clip > 0 the clipping.
StepOut nd_step(RankModel& model, const NdGroups& groups, const NdOptions& options, int64_t step);

/// What one rank put on the wire in one step for one kind of traffic (dtc::wire_bytes: the ring
/// algorithms' bytes, what a link's bandwidth is set against).
struct WireBytes {
  double measured = 0;   ///< NdGroups::recorders' calls, summed, per step (the mean of the steps)
  double predicted = 0;  ///< predict_wire_bytes()
  std::string formula;   ///< the closed form, in words
};

/// @brief What this rank sends per step, by the closed forms of the pieces it runs, with
///   m micro-batches of b sequences (MICRO) of s/cp tokens, h hidden, e bytes an element (the
///   parameters' dtype; 4 between stages, which send fp32), L_r the blocks this rank holds:
///   - tp: lesson 08's 4 allreduces per block and micro-batch of b (s/cp) h elements (6 with
///     full recomputation), 2(tp-1)/tp of each;
///   - pp: one send of the b (s/cp) h activations per micro-batch out of each chunk that is not
///     the model's last, one of their gradient out of each that is not its first (the whole
///     tensor from every tp rank: no scatter/gather), and the loss's allreduce of 4 bytes;
///   - cp: lesson 10's attention_volume() per block and micro-batch over the h/tp of a tp rank
///     (its forward once more with full recomputation), and the loss's allreduce;
///   - dp: the gradient reduction, an allreduce over gradient_reduction()'s dp x cp ranks of
///     every gradient this rank holds, in fp32 whatever e (lesson 09's flat buffer) (ZeRO: a
///     reduce-scatter of them in fp32 over the n = dp_shard x cp ranks, padded to multiples of
///     n, and an all-gather of the updated shards in e, the same bytes for every stage; HSDP: an
///     allreduce of the fp32 shards over dp / N besides), and the loss's allreduce over dp;
///   - embedding: the tied embedding's V h gradient allreduced over its 2 stages;
///   - norm: with --clip, one allreduce of the norm (a double) over the pp x tp ranks (ZeRO:
///     pp x dp_shard x cp x tp, every rank without HSDP).
/// The group sizes are the mix's degrees (dp x cp for the reduction), whatever groups the
/// learner's dims chose.
std::map<std::string, WireBytes> predict_wire_bytes(const NdOptions& options,
                                                    const RankModel& model);

/// The bytes of one rank's training state, counted from its tensors after the last step.
/// Each tensor's storage is counted once, at its bytes now (a freed one: 0).
struct StateMemory {
  int64_t params = 0;     ///< its parameters: its stages' blocks, tp shards, the tied copy (ZeRO-3:
                          ///< its shards of them)
  int64_t grads = 0;      ///< their gradients (whole; ZeRO-2 and 3: its shards of them)
  int64_t optimizer = 0;  ///< AdamW's two moments (ZeRO: of its shards)
  int64_t zero_copies = 0;  ///< what ShardedAdamW holds besides: ZeRO-1 its shards' fp32 copies
                            ///< and their gradients, ZeRO-2 the copies; 0 for ZeRO-3 (in bf16
                            ///< these copies are the fp32 master weights)
  int64_t masters = 0;      ///< bf16 without ZeRO: MasterAdamW's fp32 copies of the parameters
};

/// @brief What this rank's forwards hold when its first backward pass starts (StepOut's
///   activation_bytes), by the closed forms of lessons 02 and 10, in fp32 without recomputation,
///   for the forwards the schedule runs before its first backward on pipeline rank @p pp_rank:
///   min(m, p - s) under 1F1B, all m under GPipe, Megatron's warm-up under the interleaved
///   schedule (counted from l09::make_schedule). Per micro-batch of n = b s / cp tokens and chunk:
///   - each block: l10::predict_layer_activation_bytes (the LayerNorms' inputs, outputs and
///     statistics, the tp-split Q, K, V, c_proj input and MLP tensors, the attention's scores
///     and causal mask, or the ring's output and log-sum-exp with cp > 1; with one head a rank
///     the ring's output is a view, not a copy);
///   - a chunk before the model's last: its output, 4 n h, which the executor keeps to run the
///     backward from (no block saves it);
///   - the model's last chunk: ln_f's input and output (4 n h each), its statistics (8 n) and the
///     logits, 4 n V (the loss is computed from them after the forward).
///   - the model's first chunk: the positions 0 .. s-1 (int64), 8 s, which wpe's backward keeps
///     (with cp > 1 they are the stage's own, made once).
///   The tokens are views of the batch. @return -1 where no closed form
///   is written: bf16, --recompute full, or sequence parallelism.
int64_t predict_activation_bytes(const NdOptions& options, int pp_rank);

/// What a run gives back.
struct NdResult {
  std::vector<float> losses;       ///< every step's loss
  std::vector<double> grad_norms;  ///< every step's norm before clipping (with --clip)
  nlohmann::json digest;           ///< the full model's param_digest (every rank), when asked
  /// this rank's parameters after the last step, under the full model's names (tp shards as
  /// held; the tied head's copy left out); in bf16 their fp32 master weights (ZeRO: every rank's
  /// shards gathered)
  std::vector<std::pair<std::string, torch::Tensor>> weights;
  /// the elements of AdamW's two moments this rank keeps after the run (ZeRO-1: of its shards)
  int64_t optimizer_elements = 0;
  /// this rank's state after the last step (each parameter's storage counted once)
  StateMemory memory;
  /// the bytes this rank sent per step, by kind of traffic (predict_wire_bytes()'s keys), measured
  /// over the training steps (not the start's check or the digest) beside the closed forms
  std::map<std::string, WireBytes> wire_bytes;
  /// StepOut::activation_bytes of the last step (-1: not measured)
  int64_t activation_bytes = -1;
  /// the most bytes this rank held during the last step (ZeRO-3's gather, the schedule, the
  /// reductions, clipping and the optimizer): the counting allocator's peak of the storage this
  /// thread allocated (dtc::thread_cpu_memory), everything it holds counted, its state too.
  /// -1 when the allocator is not installed.
  int64_t peak_bytes = -1;
};

/// The optimizer's view of one of this rank's parameters (NdTrainer::slots()): the tensor AdamW
/// steps, and which elements of the parameter it is.
struct OptimizerSlot {
  torch::Tensor param;  ///< the parameter (whole, or this rank's tp slice), as the model holds it
  /// what AdamW steps and keeps moments of: @p param itself, or under ZeRO this rank's fp32
  /// shard of it (flattened elements [begin, begin + numel)); undefined when it owns none
  torch::Tensor stepped;
  int64_t begin = 0;  ///< the shard's first element in the flattened parameter (0 without ZeRO)
};

/// train_nd()'s loop a step at a time, with its state in reach (lesson 12 saves and restores it
/// between steps). fp32 and bf16, with or without ZeRO, as train_nd().
class NdTrainer {
 public:
  /// This rank's model (build_rank_model()) and its optimizer (AdamW; ZeRO's ShardedAdamW; in
  /// bf16 master weights).
  NdTrainer(const NdOptions& options, const NdGroups& groups);
  ~NdTrainer();
  NdTrainer(const NdTrainer&) = delete;
  NdTrainer& operator=(const NdTrainer&) = delete;

  /// Step @p step (its batch: the data's rows of that step): ZeRO-3's gather, nd_step(), the
  /// optimizer's step.
  StepOut step(int64_t step);
  RankModel& model() { return model_; }
  /// The parameters of model(), in l09::parameters_of() order.
  const std::vector<torch::Tensor>& parameters() const { return params_; }
  /// One slot per parameter, in parameters() order (fp32 runs: in bf16 the master weights are
  /// not the parameters, and these slots do not say where they are).
  std::vector<OptimizerSlot> slots();
  /// The AdamW that steps the slots' tensors (null under ZeRO on a rank that owns no element).
  torch::optim::AdamW* optimizer();
  /// ZeRO: after the slots' shards were written from outside (a checkpoint), the parameters
  /// made from them again (ShardedAdamW::params_from_shards()). Nothing otherwise: there the
  /// slots are the parameters.
  void shards_written();
  /// The run's summary after its last step (NdResult less losses and norms): the state's bytes,
  /// the optimizer's elements, the weights, and with options.digest the digest (collectives:
  /// every rank calls it).
  NdResult finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  RankModel model_;
  std::vector<torch::Tensor> params_;
};

/// options.steps steps of nd_step() and AdamW on this rank's parameters (an NdTrainer). Reads and
/// clears @p groups' recorders after each step (through their pointers: the groups stay as they
/// are).
NdResult train_nd(const NdOptions& options, const NdGroups& groups, StepLog* log = nullptr);

}  // namespace dtc::l11
