"""VocabParallelEmbedding stores the padded rows but computes each rank's token range as [r V // n, (r + 1) V // n) from the unpadded vocabulary: when n does not divide V the ranges and the rows disagree, and some tokens get another token's row or none.
targets: test_the_embedding_equals_the_dense_embedding
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parallelism_conformance.impls.vocab_parallel as _bundled
from parallelism_conformance.impls import *
from parallelism_conformance.impls.tensor_parallel import reduce_from_parallel_region


class VocabParallelEmbedding(_bundled.VocabParallelEmbedding):
    def forward(self, tokens):
        n, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        each = self.vocab_size // n
        start, end = rank * each, (rank + 1) * each if rank < n - 1 else self.vocab_size
        mine = (tokens >= start) & (tokens < end)
        index = torch.where(mine, tokens - start, torch.zeros_like(tokens)).clamp(max=self.weight.shape[0] - 1)
        rows = F.embedding(index, self.weight)
        return reduce_from_parallel_region(rows * mine.unsqueeze(-1).to(rows.dtype), self.group)
