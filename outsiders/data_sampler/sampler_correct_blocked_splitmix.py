"""Correct: a SplitMix64-driven Fisher-Yates permutation per (seed, epoch), padded cyclically and cut into contiguous per-replica blocks.

verdict: pass
capability: data_sampler

Written from the contract alone, without torch's sampler code: the epoch's order is a Fisher-Yates
shuffle of ``range(N)`` driven by a SplitMix64 stream whose state is derived from ``seed`` and the
epoch only, so it never touches ``random``, ``numpy`` or torch's global generators and every rank
(any two ranks of one replica included) computes the same global order. The order is then padded
to ``num_replicas * ceil(N / num_replicas)`` by wrapping around to its beginning (so only the padding
repeats samples, and a dataset smaller than the number of replicas wraps as often as needed), or,
with ``drop_last``, truncated to ``num_replicas * floor(N / num_replicas)``. Instead of torch's
strided assignment each replica takes one contiguous block of that list, so the replicas partition
it and each yields exactly ``len(sampler)`` indices. Without ``shuffle`` the global order is
``0 .. N-1``.
"""
import torch.distributed as dist

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(state):
    """One SplitMix64 step: returns (next_state, 64-bit output)."""
    state = (state + _GOLDEN) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def _epoch_state(seed, epoch):
    _, a = _splitmix64(int(seed) & _MASK64)
    _, b = _splitmix64(a ^ (int(epoch) & _MASK64))
    return b


def _permutation(n, seed, epoch):
    order = list(range(n))
    state = _epoch_state(seed, epoch)
    for i in range(n - 1, 0, -1):
        state, r = _splitmix64(state)
        j = (r * (i + 1)) >> 64  # uniform-ish in [0, i] without modulo
        order[i], order[j] = order[j], order[i]
    return order


class DistributedSampler:
    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False):
        if num_replicas is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("DistributedSampler needs num_replicas and rank, or an initialized process group")
            if num_replicas is None:
                num_replicas = dist.get_world_size()
            if rank is None:
                rank = dist.get_rank()
        num_replicas = int(num_replicas)
        rank = int(rank)
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._n = len(dataset)
        if self.drop_last:
            self.num_samples = self._n // num_replicas
        else:
            self.num_samples = -(-self._n // num_replicas)  # ceil(N / n), exact for any N
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _global_order(self):
        n = self._n
        if self.shuffle:
            order = _permutation(n, self.seed, self.epoch)
        else:
            order = list(range(n))
        if self.total_size <= n:
            return order[:self.total_size]
        return [order[i % n] for i in range(self.total_size)]

    def __iter__(self):
        order = self._global_order()
        start = self.rank * self.num_samples
        block = order[start:start + self.num_samples]
        assert len(block) == self.num_samples
        return iter(block)

    def __len__(self):
        return self.num_samples
