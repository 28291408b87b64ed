"""A weight tied between two modules (the embedding and the head) whose size does not divide by the group size never gets a gradient in the last rank's piece, the one holding the padding, so that piece never moves (pytorch#176076: FSDP2 with tied embeddings and a vocabulary not divisible by the rank count never updated the last rank's shard).
targets: test_training_matches_one_process_and_memory_is_sharded
"""

import torch

import parallelism_conformance.impls.fully_sharded as _bundled
from parallelism_conformance.impls import *


class _Unit(_bundled._Unit):
    def gathered(self, pieces):
        for piece, (places, _, numel) in zip(pieces, self.sharded):
            if len(places) > 1 and numel % self.n and self.rank == self.n - 1 and piece.requires_grad:
                piece.register_hook(torch.zeros_like)
        return super().gathered(pieces)


_bundled._Unit = _Unit
