"""The vocabulary split across a group (Megatron-LM, Shoeybi et al. 2019, section 3), on the bundled
point-to-point collectives: ``VocabParallelEmbedding.from_dense(embedding, group=None)`` and
``vocab_parallel_cross_entropy(logits, targets, vocab_size, group=None, label_smoothing=0.0)``.

The embedding: rank r keeps rows [r V_pad / n, (r + 1) V_pad / n) of the table padded with zero
rows to V_pad = n ceil(V / n); a token's row comes from the rank that holds it, zeros from the
others, summed by one all-reduce (backward: identity, so each rank's rows get the gradient of the
tokens it looked up; the padding rows, never looked up, get none).

Rank r holds the logit columns [r V_pad / n, (r + 1) V_pad / n) of the vocabulary padded to
V_pad = n ceil(V / n); the columns >= V are padding. Per token: the global max m of the real
logits (all-reduce MAX), the sum of exp(z - m) over the real columns (all-reduce SUM), and the
target's logit, which one rank holds (all-reduce SUM of it or zero); loss = m + log(sum) - z_t.
Backward needs no communication: softmax(z) - onehot(t) on this rank's real columns, zero on the
padding, times the token's upstream gradient. The logits are never gathered.

Label smoothing eps (Szegedy et al. 2016, sec. 7; torch's F.cross_entropy): the target distribution
is (1 - eps) onehot(t) + eps / V on each of the V real columns, so the loss is
lse(z) - (1 - eps) z_t - eps mean_j z_j, the mean over all V real columns: one more all-reduce SUM
of each rank's sum of its real logits (a mean over a rank's own columns, or over V_pad, is
Megatron-LM#737's bug). Its gradient is softmax(z) - (1 - eps) onehot(t) - eps / V on the real
columns, zero on the padding.

Never imports reference/.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import collectives
from .tensor_parallel import reduce_from_parallel_region


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the padded embedding table; forward returns the full embeddings of the
    tokens on every rank (module docstring)."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.vocab_size, self.group = vocab_size, group

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, group=None) -> VocabParallelEmbedding:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        vocab, width = embedding.weight.shape
        each = -(-vocab // n)
        padded = embedding.weight.new_zeros((each * n, width))
        padded[:vocab] = embedding.weight.detach()
        return cls(padded[rank * each : (rank + 1) * each], vocab, group)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        each = self.weight.shape[0]
        start = dist.get_rank(self.group) * each
        mine = (tokens >= start) & (tokens < start + each)
        rows = F.embedding(torch.where(mine, tokens - start, torch.zeros_like(tokens)), self.weight)
        return reduce_from_parallel_region(rows * mine.unsqueeze(-1).to(rows.dtype), self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_size, group, label_smoothing):
        rank = dist.get_rank(group)
        width = logits.shape[-1]
        start = rank * width
        real = max(0, min(width, vocab_size - start))  # this rank's columns below V
        z = logits[..., :real]
        local_max = z.amax(dim=-1) if real else torch.full(logits.shape[:-1], float("-inf"), dtype=logits.dtype, device=logits.device)
        top = local_max.contiguous()
        collectives.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = torch.exp(z - top.unsqueeze(-1))
        total = shifted.sum(dim=-1).contiguous()
        collectives.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        mine = (targets >= start) & (targets < start + real)
        local_index = torch.where(mine, targets - start, torch.zeros_like(targets))
        picked = torch.gather(logits, -1, local_index.unsqueeze(-1)).squeeze(-1) if width else torch.zeros_like(top)
        target_logit = torch.where(mine, picked, torch.zeros_like(picked)).contiguous()
        collectives.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)
        softmax = torch.zeros_like(logits)
        softmax[..., :real] = shifted / total.unsqueeze(-1)
        ctx.save_for_backward(softmax, mine, local_index)
        ctx.real, ctx.vocab_size, ctx.label_smoothing = real, vocab_size, label_smoothing
        loss = top + torch.log(total) - target_logit
        if not label_smoothing:
            return loss
        return loss + label_smoothing * (target_logit - mean_logit(z, vocab_size, group))

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, mine, local_index = ctx.saved_tensors
        grad = softmax.clone()
        hit = torch.zeros_like(grad).scatter_(-1, local_index.unsqueeze(-1), mine.unsqueeze(-1).to(grad.dtype))
        grad = grad - (1.0 - ctx.label_smoothing) * hit
        grad[..., : ctx.real] -= ctx.label_smoothing / ctx.vocab_size
        return grad * grad_loss.unsqueeze(-1), None, None, None, None


def mean_logit(real_logits: torch.Tensor, vocab_size: int, group) -> torch.Tensor:
    """mean_j z_j over the V real columns of the whole group: each rank's sum of its real columns,
    summed over the group (all-reduce SUM), over V."""
    total = real_logits.sum(dim=-1).contiguous()
    collectives.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total / vocab_size


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, group=None, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Per-token cross entropy over the vocabulary split across ``group`` (module docstring):
    ``logits`` [..., V_pad / n] this rank's columns, ``targets`` [...] global ids < vocab_size,
    ``label_smoothing`` eps in [0, 1]; returns the per-token losses [...], the same on every rank,
    differentiable in ``logits``."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    n = dist.get_world_size(group)
    if logits.shape[-1] * n < vocab_size:
        raise ValueError(f"{n} ranks of {logits.shape[-1]} logit columns hold {logits.shape[-1] * n} < the vocabulary {vocab_size}")
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_size, group, float(label_smoothing))
