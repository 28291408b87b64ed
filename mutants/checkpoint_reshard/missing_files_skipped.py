"""The loader reads whichever rank files it finds, and nothing checks that the pieces cover every tensor: a checkpoint missing a file loads with zeros where that file's pieces were.
targets: test_a_checkpoint_resumes_under_another_layout_and_world_size
"""
import os

from impls import *
from impls import checkpointing


def load_checkpoint(path, model, optimizer):
    read, check_whole = checkpointing._read, checkpointing._check_whole

    def skip_missing(path, name, what):
        if name.startswith("rank") and not os.path.exists(os.path.join(path, name)):
            return {"format": checkpointing.FORMAT, "pieces": [], "scalars": []}
        return read(path, name, what)

    checkpointing._read, checkpointing._check_whole = skip_missing, lambda *args: None
    try:
        checkpointing.load_checkpoint(path, model, optimizer)
    finally:
        checkpointing._read, checkpointing._check_whole = read, check_whole
