"""sync_tied_gradients addresses the first and last stage by their ranks in the pipeline group taken as global ranks: right on a pipeline of the whole world, on a mesh another replica's or shard's rank, which refuses or never answers.
targets: whole_block
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls import tied_weights

tied_weights._global = lambda group, rank: rank
