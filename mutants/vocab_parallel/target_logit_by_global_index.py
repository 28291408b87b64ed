"""vocab_parallel_cross_entropy looks the target up on every rank by its global id, modulo the rank's width, instead of on the one rank that holds it: the target logit is summed from n columns.
targets: test_the_loss_and_its_gradient_equal_the_dense_cross_entropy
"""

import torch
import torch.distributed as dist

import parallelism_conformance.impls.vocab_parallel as _bundled
from parallelism_conformance.impls import *

_forward = _bundled._VocabParallelCrossEntropy.forward


class _Wrong(_bundled._VocabParallelCrossEntropy):
    @staticmethod
    def forward(ctx, logits, targets, vocab_size, group):
        loss = _forward(ctx, logits, targets, vocab_size, group)
        width = logits.shape[-1]
        rank = dist.get_rank(group)
        start = rank * width
        mine = (targets >= start) & (targets < start + width)
        wrong = torch.gather(logits, -1, (targets % width).unsqueeze(-1)).squeeze(-1)
        right = torch.where(
            mine, torch.gather(logits, -1, (targets - start).clamp(0, width - 1).unsqueeze(-1)).squeeze(-1), torch.zeros_like(wrong)
        )
        extra = (wrong - right).contiguous()
        _bundled.collectives.all_reduce(extra, op=dist.ReduceOp.SUM, group=group)
        return loss - extra


def vocab_parallel_cross_entropy(logits, targets, vocab_size, group=None):
    return _Wrong.apply(logits, targets, vocab_size, group)
