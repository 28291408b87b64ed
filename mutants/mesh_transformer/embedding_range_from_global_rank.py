"""VocabParallelEmbedding looks tokens up in the vocabulary range of its global rank, not of its rank in the tensor-parallel group: right when tensor parallelism spans the world, zeros for the tokens of every replica but the first on a mesh.
targets: whole_block
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallelism_conformance.impls import *
from parallelism_conformance.impls import vocab_parallel


class VocabParallelEmbedding(vocab_parallel.VocabParallelEmbedding):
    def forward(self, tokens):
        each = self.weight.shape[0]
        start = dist.get_rank() * each
        mine = (tokens >= start) & (tokens < start + each)
        rows = F.embedding(torch.where(mine, tokens - start, torch.zeros_like(tokens)), self.weight)
        return vocab_parallel.reduce_from_parallel_region(rows * mine.unsqueeze(-1).to(rows.dtype), self.group)
