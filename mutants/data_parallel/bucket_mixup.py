"""Bucketed DP copies a reduced bucket back to the wrong parameter when the bucket holds two of the same size.
targets: test_training_matches_one_process_on_the_global_batch or test_bucketed_gradients_are_the_mean_over_ranks or test_a_single_bucket_of_equal_sized_parameters
"""

from parallelism_conformance.impls import *
from parallelism_conformance.impls.data_parallel import BucketedDataParallel, OverlappedDataParallel


class Mixup(BucketedDataParallel):
    def finish_gradient_synchronization(self):
        for bucket in self._buckets:
            if bucket.future is None and bucket.ready:
                self._start(bucket)
        for bucket in self._buckets:
            if bucket.future is not None:
                bucket.future.result()
                for i in bucket.ready:
                    j = len(bucket.params) - 1 - i
                    if bucket.params[j].numel() == bucket.params[i].numel() and bucket.params[j].grad is not None:
                        bucket.params[i].grad.copy_(bucket.slot(j).view_as(bucket.params[i].grad))
                    else:
                        bucket.params[i].grad.copy_(bucket.slot(i))
            bucket.flat.zero_()
            bucket.ready.clear()
            bucket.future = None


def DataParallel(module, bucket_size_mb=None):
    return OverlappedDataParallel(module) if bucket_size_mb is None else Mixup(module, bucket_size_mb)
