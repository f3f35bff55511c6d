// Lesson 10 (given): the all-to-all, Ulysses' and all-gather's attention around your layouts and
// gather, the choice between the three, and the context-parallel GPT (lesson 02's GPT with your
// attention swapped in). Your part is in context_parallel.cpp; both implement context_parallel.h.
#include <stdexcept>
#include <vector>

#include "context_parallel.h"

namespace dtc::l10 {

namespace F = torch::nn::functional;

// ---------------------------------------------------------------------------------------------
// Ulysses' and all-gather's attention, around your layouts and gather
// ---------------------------------------------------------------------------------------------

torch::Tensor all_to_all(const torch::Tensor& x, Comm& comm) {
  torch::Tensor input = x.contiguous();
  torch::Tensor output = torch::empty_like(input);
  std::vector<int64_t> equal;  // empty: equal splits along dim 0
  comm.alltoall_base(output, input, equal, equal)->wait();
  return output;
}

namespace {

// Every rank's positions, in rank order: the order of the gathered sequence.
torch::Tensor all_positions(int64_t seq, int cp, bool zigzag) {
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < cp; ++r) parts.push_back(local_positions(seq, r, cp, zigzag));
  return torch::cat(parts);
}

}  // namespace

torch::Tensor ulysses_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, Comm& cp, bool zigzag, bool causal) {
  const int n = cp.getSize();
  const torch::Tensor pos = all_positions(q.size(2) * n, n, zigzag);
  const torch::Tensor y = masked_attention(seq_to_heads(q, cp), seq_to_heads(k, cp),
                                           seq_to_heads(v, cp), pos, pos, causal);
  return heads_to_seq(y, cp);
}

torch::Tensor allgather_attention(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, Comm& cp, bool zigzag, bool causal) {
  const int n = cp.getSize();
  const int64_t seq = q.size(2) * n;
  return masked_attention(q, gather_sequence(k, cp), gather_sequence(v, cp),
                          local_positions(seq, cp.getRank(), n, zigzag),
                          all_positions(seq, n, zigzag), causal);
}

torch::Tensor context_attention(Attention kind, const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, Comm& cp, bool zigzag, bool causal) {
  switch (kind) {
    case Attention::kRing: return ring_attention(q, k, v, cp, zigzag, causal);
    case Attention::kUlysses: return ulysses_attention(q, k, v, cp, zigzag, causal);
    case Attention::kAllGather: return allgather_attention(q, k, v, cp, zigzag, causal);
  }
  throw std::invalid_argument("context_attention: unknown kind");
}

// ---------------------------------------------------------------------------------------------
// The context-parallel GPT
// ---------------------------------------------------------------------------------------------

CpGptImpl::CpGptImpl(const Gpt& full, Comm& comm, Attention k, bool zz)
    : gpt(full), cp(&comm), kind(k), zigzag(zz) {
  const GptConfig& c = full->config();
  validate_cp(c.ctx, c.heads, comm.getSize(), kind, zigzag);
  register_module("gpt", gpt);
  positions =
      local_positions(c.ctx, comm.getRank(), comm.getSize(), zigzag).to(full->wte->weight.device());
  // The same GPT with two parts swapped: its tokens' global positions, and an attention core
  // that meets the other ranks' tokens (context_attention gives (B, H, Tl, D); the core's
  // contract is (B, Tl, H x D)).
  gpt->set_positions(positions);
  // (By value: the core stays on @p full, which may outlive this wrapper.)
  gpt->set_attention_core([kind = kind, cp = cp, zigzag = zigzag](const torch::Tensor& q,
                                                                  const torch::Tensor& k,
                                                                  const torch::Tensor& v) {
    const int64_t B = q.size(0), H = q.size(1), tl = q.size(2), D = q.size(3);
    return context_attention(kind, q, k, v, *cp, zigzag)
        .transpose(1, 2)
        .contiguous()
        .view({B, tl, H * D});
  });
}

torch::Tensor CpGptImpl::forward(const torch::Tensor& tokens) { return gpt->forward(tokens); }

torch::Tensor CpGptImpl::loss(const Batch& batch) {
  const torch::Tensor logits = forward(batch.inputs);  // (B, Tl, V)
  const double all_tokens = static_cast<double>(batch.inputs.size(0)) *
                            static_cast<double>(batch.inputs.size(1) * cp->getSize());
  return F::cross_entropy(logits.view({-1, logits.size(-1)}), batch.targets.reshape({-1}),
                          F::CrossEntropyFuncOptions().reduction(torch::kSum)) /
         all_tokens;
}

}  // namespace dtc::l10
