"""Each rank reads only the file its own rank number wrote and nothing checks that the pieces cover every tensor: right when the world size is unchanged, zeros and misplaced chunks under another (the pattern of ROCm/Megatron-LM#63).
targets: test_a_checkpoint_resumes_under_another_layout_and_world_size
"""

import torch.distributed as dist

from mutants._swap import swapped
from parallelism_conformance.impls import *
from parallelism_conformance.impls import checkpointing


def _own_file_only(path, name, what, read=checkpointing._read):
    if name.startswith("rank") and name != f"rank{dist.get_rank()}.pt":
        return {"format": checkpointing.FORMAT, "pieces": [], "scalars": []}
    return read(path, name, what)


def load_checkpoint(path, model, optimizer):
    with swapped(checkpointing, _read=_own_file_only, _check_whole=lambda *args: None):
        checkpointing.load_checkpoint(path, model, optimizer)
