"""global_token_count returns this rank's own count, never reduced: each rank normalises by its own tokens, so a rank with few valid targets weighs each of them more and the gradient is up to dp times the global mean (NeMo Automodel#3830).
targets: test_data_parallel_gradients_are_the_mean_over_every_valid_token
"""

from parallelism_conformance.impls import *


def global_token_count(local_count, group=None):
    return int(local_count)
