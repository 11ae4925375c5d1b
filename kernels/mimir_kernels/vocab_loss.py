"""Output head + cross-entropy in chunks of tokens, vocabulary-parallel, without full logits.

With a 262,144-token vocabulary the fp32 logits of a 16k-token micro-batch take ~17 GB. This
computes, chunk by chunk, the logits of the local vocabulary shard, the softmax statistics
(all-reduced over the tensor-parallel group), the loss, and immediately the gradients with
respect to the hidden states and the head weight; only those gradients are kept for backward.
Peak extra memory is one chunk's logits instead of all of them.

The CPU reference is the plain path: ``head(x)`` then megatron's vocab-parallel cross-entropy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _ChunkedVocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, supervised, chunk, vocab_start, vocab_size, group):
        local_vocab = weight.shape[0]
        ids = torch.arange(vocab_start, vocab_start + local_vocab, device=weight.device)
        padding = ids >= vocab_size  # rows that exist only for divisibility
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        parallel = group is not None and dist.get_world_size(group) > 1
        for start in range(0, hidden.shape[0], chunk):
            x = hidden[start:start + chunk]
            logits = (x @ weight.t()).float().masked_fill_(padding, float("-inf"))
            peak = logits.max(dim=-1).values
            if parallel:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            logits -= peak[:, None]
            t = target[start:start + chunk] - vocab_start
            owned = (t >= 0) & (t < local_vocab)
            rows = torch.arange(x.shape[0], device=x.device)[owned]
            target_logit = torch.zeros_like(peak)
            target_logit[owned] = logits[rows, t[owned]]
            exp = logits.exp_()  # in place: the shifted logits are not needed any more
            sum_exp = exp.sum(dim=-1)
            if parallel:
                dist.all_reduce(sum_exp, group=group)
                dist.all_reduce(target_logit, group=group)
            mask = supervised[start:start + chunk].to(torch.float32)
            # loss = log(sum exp) - target logit, both shifted by the same peak
            total += ((sum_exp.log() - target_logit) * mask).sum()
            grad = exp.div_(sum_exp[:, None])  # softmax over the whole vocabulary
            grad[rows, t[owned]] -= 1.0
            grad.mul_(mask[:, None])
            grad_hidden[start:start + chunk] = (grad @ weight.float()).to(hidden.dtype)
            grad_weight += grad.t() @ x.float()
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_output, grad_weight * grad_output, None, None, None, None, None, None


def chunked_vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    supervised: torch.Tensor,
    chunk_tokens: int,
    vocab_start: int,
    vocab_size: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Sum over supervised tokens of the cross-entropy of ``hidden @ weight.T``.

    Args:
        hidden: ``[tokens, hidden]``, the same on every TP rank (its gradient is this rank's
            partial sum over the local vocabulary: reduce it over TP, as megatron's region
            functions do).
        weight: ``[local_vocab, hidden]``, this rank's rows ``vocab_start .. vocab_start+local``.
        target: ``[tokens]`` global token ids (any value where not supervised).
        supervised: ``[tokens]`` bool.
        vocab_size: real vocabulary; rows at or beyond it are padding and get no probability.
        group: the tensor-parallel group (None or size 1: no communication).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    target = torch.where(supervised, target, torch.zeros_like(target))
    return _ChunkedVocabParallelCE.apply(hidden, weight, target, supervised, chunk_tokens,
                                         vocab_start, vocab_size, group)
