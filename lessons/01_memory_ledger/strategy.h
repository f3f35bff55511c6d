// Lesson 01 contract, part 2: the five parallelism strategies, and choosing a mix.
//
// Part 1 (ledger.h) answers "how many bytes does training hold per GPU?". This part answers
// "how do I split the work over a cluster?": what each strategy shards, what it sends over
// which link, and the outline's decision tree that picks a mix (dp, tp, pp, cp, ZeRO stage,
// recomputation) for a model on a cluster. This header is the whole specification of what you
// implement in strategy.cpp; README.md part 2 beside it teaches the formulas. Build and test:
//
//   make test-lesson01
//   build/bin/lesson01 --plan --model llama3-70b --cluster dgx-h100 --gpus 64
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ledger.h"

namespace dtc::l01 {

// ---------------------------------------------------------------------------------------------
// Clusters
// ---------------------------------------------------------------------------------------------

/// A cluster of identical nodes. Bandwidths are per GPU and per direction: the bytes one GPU
/// can send each second while it also receives as many. That is the "bus bandwidth" that
/// nccl-tests reports, so bytes sent per GPU / bandwidth = a collective's time.
struct Cluster {
  std::string name = "custom";  ///< preset name, or "custom"
  int64_t gpus_per_node = 8;    ///< g: GPUs that share the fast intra-node link
  double gpu_mem_gb = 80;       ///< memory per GPU, GB (1e9 bytes)
  double intra_gbps = 450;      ///< GB/s per GPU per direction inside a node (NVLink, PCIe)
  double inter_gbps = 50;       ///< GB/s per GPU per direction between nodes (InfiniBand, Ethernet)
  double peak_tflops = 989;     ///< dense BF16 TFLOP/s per GPU
};

/// The clusters the course knows by name: dgx-h100, h200x8, dgx-a100, pcie-ethernet, and
/// course-cpu, the course's own 8 CPU ranks with 8 MiB each (sources in strategy_given.cpp).
const std::vector<Cluster>& cluster_presets();

/// @p bytes in GB with @p decimals decimals ("65.73 GB"), or in MiB below 0.1 GB ("7.20 MiB"):
/// the course cluster's budgets are a few MiB.
std::string memory_text(double bytes, int decimals);

/// The cluster preset called @p name.
/// @throws dtc::UsageError("--cluster") listing the known names when there is none.
Cluster cluster_preset(const std::string& name);

/// Checks a cluster, and a GPU count on it.
/// @throws dtc::UsageError naming the flag: --gpus-per-node below 1; --gpu-mem, --intra-bw,
///   --inter-bw or --peak-tflops not positive; --gpus below 1, or neither a divisor of
///   gpus_per_node (part of one node) nor a multiple of it (whole nodes).
void validate(const Cluster& cluster, int64_t gpus);

// ---------------------------------------------------------------------------------------------
// Strategies, collectives, mixes
// ---------------------------------------------------------------------------------------------

/// The outline's five strategies; data parallelism comes in four ZeRO flavours. Besides them,
/// expert parallelism (kEp) for a mixture of experts.
enum class Strategy {
  kDdp,    ///< data parallel: full replica per GPU, allreduce of gradients
  kZero1,  ///< + optimizer states sharded over the data-parallel ranks
  kZero2,  ///< + gradients sharded
  kZero3,  ///< + parameters sharded (FSDP)
  kTp,     ///< tensor parallel (Megatron), with sequence parallelism for the norms/dropout
  kPp,     ///< pipeline parallel: consecutive layers on consecutive GPUs (1F1B)
  kCp,     ///< context parallel: the sequence split over GPUs (all-gather of K and V)
  /// expert parallel (MoE): each GPU of ep holds E/ep routed experts; all-to-alls send each
  /// token to its experts' GPUs and the results back
  kEp,
};

/// The seven of the outline's table, kDdp to kCp, in the order above (kEp aside).
const std::vector<Strategy>& all_strategies();
/// "DP/DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3/FSDP", "TP(+SP)", "PP", "SP/CP", "EP".
std::string strategy_name(Strategy s);
/// The data-parallel flavour for a ZeRO stage: 0 -> kDdp, 1 -> kZero1, ...
Strategy zero_strategy(int zero_stage);

/// The collectives of NCCL.
enum class Collective {
  kAllReduce,      ///< every rank ends with the sum of everyone's array
  kReduceScatter,  ///< every rank ends with 1/n of the summed array
  kAllGather,      ///< every rank ends with everyone's 1/n pieces, concatenated
  kSendRecv,       ///< point to point: one rank sends its array to one other
  kAllToAll,       ///< every rank sends 1/n of its array to each rank (itself included)
};

/// A parallel layout: the degrees multiply to the GPU count. Ranks are ordered tp (fastest
/// varying, neighbours), then cp, then pp, then dp (Llama 3 paper, sec. 3.3.2: [TP, CP, PP, DP]).
/// Besides the degrees, the levers a real run turns: the micro-batch size, the interleaved
/// schedule's virtual stages, HSDP's shard group, and a mixture of experts' expert parallelism.
struct Mix {
  int64_t dp = 1;  ///< data-parallel replicas
  int64_t tp = 1;  ///< tensor-parallel degree (with sequence parallelism when > 1)
  int64_t pp = 1;  ///< pipeline stages
  int64_t cp = 1;  ///< context-parallel degree
  int zero_stage = 0;
  Recompute recompute = Recompute::kNone;
  int64_t micro_batch = 1;  ///< b, sequences per micro-batch on one GPU
  /// v, model chunks per pipeline stage: 1 is plain 1F1B; v > 1 Megatron's interleaved 1F1B
  /// (Narayanan et al. 2021 sec. 2.2.2), which divides the bubble by v, multiplies the
  /// pipeline's sends by v, and keeps more micro-batches in flight.
  int64_t virtual_stages = 1;
  /// HSDP (FSDP's HYBRID_SHARD, a 2-D device mesh in FSDP2): with zero_stage 3, shard the
  /// states over groups of this many data-parallel ranks and replicate them across the
  /// dp * cp / shard groups. 0: one group of all dp * cp ranks (plain ZeRO-3).
  int64_t shard = 0;
  /// Expert parallelism (mixtures of experts): each GPU holds E/ep of every MoE block's routed
  /// experts. The ep ranks are ep consecutive data-parallel ranks (TrainingSetup::ep: ep divides
  /// dp, and the shard group under HSDP), so ep adds no GPUs.
  int64_t ep = 1;
  /// dp * tp * pp * cp.
  int64_t gpus() const { return dp * tp * pp * cp; }
  /// The ranks ZeRO shards over: shard when set, else dp * cp.
  int64_t zero_degree() const { return shard > 0 ? shard : dp * cp; }
};

/// What to plan for.
struct PlanRequest {
  ModelConfig model;
  /// Precision, optimizer, fp32_grad_accum, seq and attention are used, and ep, which every
  /// candidate mix keeps (Mix::ep); dp, tp, pp, micro_batch, zero_stage, recompute and
  /// sequence_parallel are what the plan chooses (in a Mix), and are ignored here.
  TrainingSetup setup;
  Cluster cluster;
  int64_t gpus = 8;          ///< G, the GPUs to use
  int64_t global_batch = 0;  ///< B, sequences per optimizer step; 0: 2^22 tokens (4M) / seq
  double mfu = 0.4;          ///< model FLOPs utilisation assumed for compute time
  double tokens = 1e12;      ///< training tokens, for the time to train
  /// The plan tries micro-batches of 1, 2, 4, ... up to this many sequences.
  int64_t max_micro_batch = 8;
  /// B, with the default applied.
  int64_t batch() const;
};

/// Checks a request: the model, the set-up, the cluster and the GPU count.
/// @throws dtc::UsageError naming the flag (see validate() above and in ledger.h), and
///   --global-batch when B is negative, --max-micro-batch below 1, --mfu outside (0, 1],
///   --tokens not positive, --ep (above 1) for a dense model, not dividing the experts or not
///   dividing the GPUs.
void validate(const PlanRequest& req);

// ---------------------------------------------------------------------------------------------
// What you implement (strategy.cpp)
// ---------------------------------------------------------------------------------------------

/// Bytes each of @p n ranks sends for one collective over an array of @p bytes, in NCCL's ring
/// algorithms. @p bytes is the whole array: for reduce-scatter the input, for all-gather the
/// output (nccl-tests' convention). The factors are nccl-tests' bus-bandwidth factors:
/// allreduce 2(n-1)/n (a reduce-scatter then an all-gather), reduce-scatter and all-gather
/// (n-1)/n, send/recv 1. One rank (n = 1) sends nothing, except send/recv, which always sends.
double collective_bytes(Collective c, double bytes, int64_t n);

/// Micro-batches each pipeline runs per optimizer step: m = B / (dp * mix.micro_batch). Given.
double micro_batches(const PlanRequest& req, const Mix& mix);

/// w, the bytes of a weight on the wire (the all-gathers of parameters): 2 in mixed precision,
/// 4 in fp32. Given.
double weight_wire_bytes(const TrainingSetup& setup);
/// g, the bytes of a gradient on the wire (allreduces and reduce-scatters): the dtype the
/// gradients are summed in. 4 with fp32 gradients (kMixedFp32Grads, or fp32_grad_accum's
/// buffer: Megatron-LM reduces that buffer, grad_reduce_in_fp32) and in fp32; w with 16-bit
/// gradients. Given.
double gradient_wire_bytes(const TrainingSetup& setup);

/// Bytes one GPU sends in one optimizer step for @p s inside @p mix, with
/// P_r = params / (tp * pp) the parameters a replica holds, w = weight_wire_bytes() and
/// g = gradient_wire_bytes() the bytes of a weight and of a gradient on the wire,
/// m = micro_batches(), s the sequence, b = mix.micro_batch, h hidden, L layers, and
/// activations 16-bit (2 bytes a value, as in the ledger):
///   - kZero1..3 use n = mix.zero_degree() (dp * cp: context-parallel ranks hold the same
///     weights, so gradients are reduced over both; or HSDP's shard group), kDdp n = dp * cp.
///     DDP: one allreduce of the gradients, 2(n-1)/n g P_r.
///     ZeRO-1: reduce-scatter of gradients + all-gather of the updated parameters, once a step:
///     (n-1)/n (g + w) P_r, DDP's volume when g = w (ZeRO paper sec. 7.2.1). ZeRO-2 keeps only
///     its gradient shard, so it reduce-scatters after every micro-batch:
///     (n-1)/n (m g + w) P_r. ZeRO-3 gathers the parameters for the forward and again for the
///     backward and reduce-scatters the gradients, every micro-batch: m (n-1)/n (2w + g) P_r
///     (1.5x DDP at m = 1 and g = w, ZeRO paper sec. 7.2.2).
///   - kDdp in an HSDP mix (shard > 0) is the replication across groups instead: once a step,
///     an allreduce of each rank's gradient shard, g P_r / shard, over the r = dp * cp / shard
///     replicas, 2(r-1)/r g P_r / shard.
///   - kTp, n = tp (with sequence parallelism, as the mix's memory assumes): per layer this GPU
///     holds (L/pp) and micro-batch, what 5 allreduces of the (s/cp) b h activations send. Plain
///     TP has 4, 2 forward and 2 backward (Megatron, Shoeybi et al. 2019, Fig. 3); sequence
///     parallelism makes each an all-gather + a reduce-scatter of the same volume (Korthikanti
///     et al. 2022 sec. 4.2.2), and its backward all-gathers the 2 column-parallel layers'
///     inputs again, since only their 1/tp rows were kept (Megatron-LM's linear layer): 10
///     (n-1)/n of an activation, 5 allreduces' worth. Full recomputation repeats the forward's
///     4 all-gathers and reduce-scatters: 7.
///   - kPp, n = pp: per micro-batch and model chunk a stage sends its output activations forward
///     and their gradient backward, one send each of (s/cp) b h values split over the tp ranks
///     (Narayanan et al. 2021 sec. 4.1, scatter/gather): 2 m v (s/cp) b h 2 / tp (the
///     interleaved schedule sends v times as much, sec. 2.2.2).
///   - kCp, n = cp: per layer and micro-batch, an all-gather of K and V (2 s b kv_dim values,
///     split over tp) in the forward and a reduce-scatter of their gradients in the backward
///     (Llama 3 paper sec. 3.3.2); full recomputation gathers again: 3.
///   - kEp, n = mix.ep: per MoE block this GPU holds (moe_layers()/pp) and micro-batch, the
///     T = (s/cp) b / tp tokens it routes (its sequence-parallel share) go each to k experts:
///     an all-to-all of T k h 16-bit values dispatches them to the experts' GPUs and another
///     combines the results back, in the forward and again (their gradients) in the backward:
///     4 all-to-alls, 4 (n-1)/n T k h 2 bytes (uniform routing, no deduplication of a token
///     sent twice to one GPU; full recomputation repeats the forward's 2: 6).
/// A strategy whose degree is 1 sends nothing; kDdp..kZero3 are costed whatever mix.zero_stage.
/// With ep > 1 the data-parallel flavours still reduce every expert's gradient over all their
/// ranks, an upper bound (the experts' gradients need only the dp/ep ranks that share them).
double step_bytes_per_gpu(Strategy s, const PlanRequest& req, const Mix& mix);

/// Whether the group of @p s spans more than one node, so that its ring runs at the inter-node
/// bandwidth. With the rank order tp, cp, pp, dp, a group of n ranks with stride d (tp: 1,
/// cp: tp, pp: tp * cp, dp: tp * cp * pp) lies inside one node when n * d <= gpus_per_node and
/// n * d divides gpus_per_node; a group of one rank spans nothing. The data-parallel flavours
/// (kDdp..kZero3) reduce over the dp x cp ranks: they cross when the dp group or the cp group
/// does. In an HSDP mix (shard > 0, cp 1) the ZeRO flavours run in the shard group, the first
/// shard dp ranks (stride tp * pp), and kDdp across the groups (dp / shard ranks, stride
/// tp * pp * shard). kEp's group is ep consecutive dp ranks (stride tp * cp * pp).
bool crosses_nodes(Strategy s, const Mix& mix, int64_t gpus_per_node);

/// The GPUs of @p s's group (the one that holds rank 0) that sit on one node, for the rank
/// order tp, cp, pp, dp (HSDP's shard group: the first shard dp ranks; its replica group: dp
/// ranks a shard group apart). Given.
int64_t group_ranks_per_node(Strategy s, const Mix& mix, int64_t gpus_per_node);

/// The bandwidth, GB/s per GPU per direction, at which @p s's collectives run in @p mix:
/// intra_gbps when the group lies inside a node (crosses_nodes() false); across nodes the
/// network, k * inter_gbps for the k = group_ranks_per_node() GPUs the group has on each node,
/// at most intra_gbps. On rail-optimised nodes (a NIC per GPU, as the DGX H100's eight
/// ConnectX-7) NCCL runs a ring through each NIC, so a group with k GPUs per node crosses
/// between nodes on k links at once; a group with one GPU per node (DP beside tp 8) gets one.
/// kPp's sends are point to point, each GPU on its own NIC: inter_gbps. Given.
double link_gbps(const Cluster& cluster, Strategy s, const Mix& mix);

/// The per-GPU ledger of @p mix: compute_ledger() with mix.zero_degree() as ZeRO's sharding
/// degree (the context-parallel ranks hold the same weights), tp, pp, ep, the mix's
/// micro-batch, ZeRO stage and recompute, sequence parallelism whenever tp > 1; then:
///   - context parallelism divides the activations (per layer and in total) by cp: each GPU
///     holds s/cp of the tokens, and its queries' rows of the attention scores; but the
///     all-gather CP the planner costs (kCp below) keeps the WHOLE sequence's K and V for
///     backward, not its 1/cp share: unless recompute is kFull, each layer holds
///     2 s b kv_dim (1 - 1/cp) / tp more 16-bit values (lesson 10 measures it, L10Memory.*).
///     That is lesson 10's implementation, an upper bound: Transformer Engine's all-gather CP
///     (Megatron's cp_comm_type "all_gather") saves only the local K and V and gathers them
///     again in backward, one more all-gather a layer for none of this memory;
///   - the interleaved schedule (v > 1) keeps more in flight: the first stage holds the
///     activations of ceil(L/pp) (pp + (pp-1)/v) layers instead of ceil(L/pp) pp, which is
///     Korthikanti et al. 2022 sec. 4.2.3's L (1 + (pp-1)/(pp v)) when pp divides L (Megatron's
///     warm-up, 2(pp-1) + (v-1) pp forward chunks of L/(pp v) layers, plus the one in flight);
///   - ZeRO-3 gathers one whole layer at a time: add one layer's share of the replica,
///     P / (tp * L), at the weights' bytes to state.params and at the gradients' bytes to
///     state.grads (FSDP's prefetch of the next layer would double it). So a layer that is too
///     big for one GPU does not fit with ZeRO alone: that is what TP is for.
Ledger mix_ledger(const PlanRequest& req, const Mix& mix);

/// The traffic of one group of a mix in one step.
struct GroupTraffic {
  /// The data-parallel flavour (kDdp also HSDP's replication), or kTp, kPp, kCp, kEp.
  Strategy strategy = Strategy::kDdp;
  int64_t degree = 1;          ///< the group's size n
  double bytes_per_gpu = 0;    ///< step_bytes_per_gpu()
  bool crosses_nodes = false;  ///< crosses_nodes(): runs on the network between nodes
  double gbps = 0;             ///< link_gbps(): GB/s per GPU per direction for this group
  double seconds = 0;          ///< bytes_per_gpu / gbps
};

/// A mix, costed.
struct Evaluation {
  Mix mix;
  Ledger ledger;              ///< mix_ledger()
  double capacity_bytes = 0;  ///< kUsableMemory * gpu memory: what the plan may fill
  bool fits = false;          ///< ledger.total_bytes() <= capacity_bytes
  /// The batch feeds the mix: dp * micro_batch <= B (every replica gets a micro-batch), and
  /// with a pipeline m >= pp (every stage sees at least as many micro-batches as there are
  /// stages; with fewer, 1F1B never leaves its warm-up and the bubble (pp-1)/m exceeds the
  /// compute it stalls: Narayanan et al. 2021 sec. 2.2 take m >= p throughout).
  bool batch_ok = false;
  double micro_batches = 0;  ///< micro_batches()
  /// One entry per group of degree > 1, in the order data-parallel (the mix's ZeRO flavour,
  /// its degree mix.zero_degree()), HSDP's replication (kDdp, dp * cp / shard; only when
  /// shard > 0), tp, pp, cp, ep.
  std::vector<GroupTraffic> traffic;
  double comm_time_s = 0;  ///< the sum of traffic[].seconds (no overlap: an upper bound)
  /// train_time_seconds(N, B s, peak, mfu, G) * recompute factor, N = active_params(): a
  /// mixture of experts computes with the experts a token goes through only
  double compute_time_s = 0;
  /// The 1F1B pipeline bubble, (pp - 1) / (v m): idle time over compute time (Narayanan et
  /// al. 2021 sec. 2.2.1-2.2.2; v = mix.virtual_stages).
  double bubble = 0;
  double step_time_s = 0;  ///< compute_time_s * (1 + bubble) + comm_time_s
};

/// A plan may fill this share of a GPU's memory; the rest is for the CUDA context, NCCL's
/// buffers, temporaries and fragmentation.
inline constexpr double kUsableMemory = 0.9;

/// The extra compute of recomputation: none 1; full 4/3 (a second forward: 8ND instead of
/// 6ND); selective 1 + s / (3 (6h + s)) (the attention core's 4bs^2h forward FLOPs again, out
/// of 3 x (24bsh^2 + 4bs^2h) per layer, Korthikanti et al. 2022 sec. 5). Given.
double recompute_flops_factor(const ModelConfig& model, int64_t seq, Recompute recompute);

/// Costs @p mix for @p req: fills every field of Evaluation as documented there.
Evaluation evaluate(const PlanRequest& req, const Mix& mix);

/// The branches of the outline's decision tree, in the order it lists them. The tree names
/// the condition that usually sends a run down each branch; the planner costs every branch and
/// says, per branch, what really decided it (Plan::branches).
enum class Family {
  kDdp,       ///< fits on one GPU: plain data parallelism over all G GPUs
  kZero,      ///< does not fit: ZeRO-1/2/3 (or HSDP) over all G GPUs
  kTensor,    ///< a layer is too big for one GPU's share: TP inside a node (+ ZeRO over dp)
  kPipeline,  ///< too many layers: PP across nodes (+ TP inside, ZeRO-1 over dp)
  kContext,   ///< the sequence is too long: CP (+ TP, PP, ZeRO)
};
/// "DDP", "ZeRO", "TP", "TP+PP (3D)", "TP+PP+CP".
std::string family_name(Family f);

/// Every valid mix of G GPUs that family @p f may use, in a fixed order (given):
///   - kDdp: dp = G, ZeRO 0;  kZero: dp = G, ZeRO 1..3, and HSDP: ZeRO 3 with shard a power
///     of two 2..min(g, G/2) that divides G (shard inside a node, replicate across);
///   - kTensor: tp a power of two 2..min(g, G) dividing heads, kv_heads and ffn; pp = cp = 1;
///   - kPipeline: tp 1 or as above, pp 2..layers dividing G / tp, cp = 1;
///   - kContext: as kTensor or kPipeline, with cp a power of two >= 2 dividing the remaining
///     GPUs, seq / (2 cp) whole (load-balanced chunks) and seq / cp >= kMinCpTokens;
/// the model-parallel families (kTensor, kPipeline, kContext) with ZeRO 0..1 over the dp * cp
/// ranks: once TP/PP split the model, only the optimizer states are sharded further (Megatron's
/// distributed optimizer), as ZeRO-2/3 would reduce or gather after every micro-batch; each
/// mix with recompute none, selective and full; micro-batches b of 1, 2, 4, ... up to
/// req.max_micro_batch with dp * b <= B, and b > 1 only where dp * b divides B; with pp > 1
/// virtual stages v = 1, 2, 4, ..., v > 1 only where v divides a stage's ceil(layers / pp)
/// layers (whole layers per chunk; the last chunks may be short, as Llama 3's 126 layers in 16
/// stages of 8) and m is a whole multiple of pp (Megatron's interleaved schedule requires it);
/// every mix with ep = req.setup.ep, and only the layouts whose dp (and HSDP shard) it divides;
/// the tp degrees also divide an MoE's expert_ffn().
std::vector<Mix> candidates(const PlanRequest& req, Family f);

/// The fewest tokens of a sequence a context-parallel GPU keeps: the cost model prices s/cp
/// tokens at the same MFU as a whole sequence, while in practice shorter chunks mean smaller
/// matmuls and K/V transfers that attention no longer hides. Every published CP layout the
/// course quotes keeps at least this many (NeMo's Llama 3 recipes: CP 2 at 8192; Llama 3 paper
/// Table 4: CP 16 at 131,072), and Megatron Core's parallelism guide names CP for sequences of
/// 8K tokens and more.
inline constexpr int64_t kMinCpTokens = 4096;

/// One branch of the decision tree, costed.
struct Branch {
  Family family = Family::kDdp;
  /// Its fastest candidate (step_time_s) that fits and is fed (batch_ok); none
  /// when no candidate of the family does.
  std::optional<Evaluation> best;
  /// What decided this branch, set by plan(): chosen for the fastest step; or it fits but
  /// its step is slower (by how much, and from what: compute, bubble, communication); or
  /// nothing fits (the least memory it would need) or no mix that fits is fed.
  std::string verdict;
};

/// A recommended mix.
struct Plan {
  Evaluation eval;  ///< the chosen mix, costed
  Family family = Family::kDdp;
  /// One reason per choice, in this order and each starting with its name: "dp N: ...",
  /// "tp N: ...", "pp N: ...", "cp N: ...", "zero K: ...", "recompute R: ...",
  /// "micro-batch B: ...", and with expert parallelism "ep N: ...".
  std::vector<std::string> reasons;
  /// The five branches of the tree, in the order of Family.
  std::vector<Branch> branches;
  bool fits = false;        ///< eval.fits && eval.batch_ok: some mix fits on G GPUs
  int64_t needs_gpus = 0;   ///< when !fits: the smallest G * 2^k that fits; 0 if none up to 2^20
  double train_time_s = 0;  ///< train_time_seconds(N, tokens, peak, mfu, G), N active params
  double train_time_1gpu_s = 0;  ///< the same on one GPU: "won't finish"
  /// When fits: the fastest mix, over the candidates of every costed branch, that fits, feeds
  /// every replica and has another layout (dp, tp, pp, cp) than eval's: the best alternative
  /// (faster than the pick only within kSimplerWithin, from a later branch). Set by plan().
  std::optional<Evaluation> runner_up;
  Family runner_up_family = Family::kDdp;
};

/// A later branch of the tree (a more complex layout) replaces an earlier one's pick only when
/// its step is more than this share faster: the cost model ignores what makes complex layouts
/// cost more than their bytes (overlap, kernel efficiency of smaller shards, latency), and the
/// simpler layout is easier to run and debug.
inline constexpr double kSimplerWithin = 0.05;

/// The planner on exactly req.gpus GPUs. It walks the outline's decision tree, but does not
/// stop at the first branch whose condition holds: it costs every branch and picks by step
/// time, as a practitioner would.
///   - branches: one per Family, in order, each with its fastest candidate that fits and is
///     fed (batch_ok) (Branch::best; verdicts are plan()'s). Every branch is costed, kContext
///     too: the tree's "the sequence is too long" is a rule of thumb, and practice runs CP at
///     8K tokens where it saves recomputation or a deeper pipeline (NeMo's Llama 3 8B and 70B
///     recipes: CP 2). The cost model prices a GPU's s/cp tokens at the same MFU as a whole
///     sequence, so CP wins only by what it saves (memory, a bubble), never by its compute.
///   - eval and family: walking the branches in order, the first best becomes the pick, and a
///     later best replaces it only when its step_time_s is below (1 - kSimplerWithin) times the
///     pick's. When no branch has one, nothing fits: eval is the candidate of any family that
///     needs the least memory (ledger.total_bytes()), family its family.
///   - reasons: explain() of eval.
/// fits, needs_gpus, the verdicts, the runner-up and the times are left to plan().
Plan choose_mix(const PlanRequest& req);

/// The reasons for the choices of @p e, chosen in family @p f, as Plan::reasons lists them:
/// why this degree for each of dp, tp, pp, cp, the ZeRO stage and recompute, with the traffic
/// and times that justify it (why TP stays on the intra-node link, why DP can take the
/// slowest). Given.
std::vector<std::string> explain(const PlanRequest& req, const Evaluation& e, Family f);

/// The plan for @p req: validate(), choose_mix(), and when nothing fits the GPU count that
/// would (needs_gpus), else the runner-up; the branches' verdicts; then the time to train on G
/// GPUs and on one. Given.
/// @throws dtc::UsageError for bad input (validate()).
Plan plan(const PlanRequest& req);

/// One row of the comparison table: one strategy alone on n GPUs.
struct StrategyRow {
  Strategy strategy = Strategy::kDdp;
  std::string splits;       ///< what it divides: the batch, a layer's matrices, the layers, ...
  std::string collectives;  ///< which collectives, and when
  std::string formula;      ///< bytes sent per GPU per step, as step_bytes_per_gpu() counts them
  int64_t degree = 1;       ///< n for this row (TP and CP: the largest valid degree <= n)
  /// Which of the ledger's states it divides per GPU, computed by comparing mix_ledger() with
  /// this strategy at degree n against one GPU: "params", "grads", "optimizer", "activations".
  std::vector<std::string> shards;
  double bytes_per_gpu = 0;  ///< step_bytes_per_gpu() with this strategy alone
  double intra_s = 0;        ///< seconds for those bytes on the intra-node link
  double inter_s = 0;        ///< ... and on the inter-node link
  double memory_bytes = 0;   ///< per-GPU memory with this strategy alone
  bool fits = false;         ///< memory_bytes <= kUsableMemory * gpu memory
};

/// The comparison table of the outline's five strategies (seven rows: DDP, ZeRO-1/2/3, TP, PP,
/// CP), each alone on @p n GPUs that together process one optimizer step of B sequences, with
/// the request's recompute (req.setup.recompute). Given: it calls your functions.
std::vector<StrategyRow> strategy_table(const PlanRequest& req, int64_t n);

}  // namespace dtc::l01
