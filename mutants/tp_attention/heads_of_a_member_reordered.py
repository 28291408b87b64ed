"""Each member keeps its heads in reverse order (its key/value groups reversed, and the query heads inside each), its output projection's columns permuted to match: every output and input gradient is the dense layer's, and the shards hold the right rows as a multiset, but not in the contract's layout, so a checkpoint or a resharding reads the wrong heads (nnsight#719: a test that compared rows as a multiset passed the wrong layout).
targets: attention
"""

import torch
import torch.distributed as dist
from torch import nn

from parallelism_conformance.impls import *
from parallelism_conformance.impls import transformer_layers
from parallelism_conformance.impls.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def _reordered(layout, my_kv, group, d):
    """For each local row of the fused projection, the local row it takes in the reversed order;
    for each local query head, the head it takes."""

    def new_to_old(a, b):  # new group a, new head b <- old group my_kv-1-a, head group-1-b
        return my_kv - 1 - a, group - 1 - b

    heads = my_kv * group
    rows, q_heads = [], []
    for a in range(my_kv):
        for b in range(group):
            j, i = new_to_old(a, b)
            q_heads.append(j * group + i)
    if layout == "concatenated":
        rows += [h * d + t for h in q_heads for t in range(d)]
        rows += [heads * d + (my_kv - 1 - a) * d + t for a in range(my_kv) for t in range(d)]
        rows += [(heads + my_kv) * d + (my_kv - 1 - a) * d + t for a in range(my_kv) for t in range(d)]
    else:
        block = (group + 2) * d
        for a in range(my_kv):
            j = my_kv - 1 - a
            rows += [j * block + (group - 1 - b) * d + t for b in range(group) for t in range(d)]
            rows += [j * block + group * d + t for t in range(2 * d)]
    return torch.tensor(rows), q_heads


class TensorParallelAttention(transformer_layers.TensorParallelAttention):
    @classmethod
    def from_dense(cls, qkv, out, num_heads, num_kv_heads, group=None, sequence_parallel=False, qkv_layout="concatenated"):
        layer = super().from_dense(qkv, out, num_heads, num_kv_heads, group, sequence_parallel, qkv_layout)
        n, r = dist.get_world_size(group), dist.get_rank(group)
        my_kv, heads_per_group, d = num_kv_heads // n, num_heads // num_kv_heads, layer.head_dim
        rows, q_heads = _reordered(qkv_layout, my_kv, heads_per_group, d)
        weight = layer.qkv.weight.detach()[rows]
        bias = None if layer.qkv.bias is None else layer.qkv.bias.detach()[rows]
        permuted = nn.Linear(out.in_features, out.out_features, bias=out.bias is not None, dtype=out.weight.dtype, device=out.weight.device)
        with torch.no_grad():
            permuted.weight.copy_(out.weight)
            if out.bias is not None:
                permuted.bias.copy_(out.bias)
            start = r * len(q_heads) * d
            for new, old in enumerate(q_heads):
                permuted.weight[:, start + new * d : start + (new + 1) * d] = out.weight[:, start + old * d : start + (old + 1) * d]
        column = ColumnParallelLinear(weight, bias, group, sequence_parallel=sequence_parallel)
        row = RowParallelLinear.from_dense(permuted, group, sequence_parallel=sequence_parallel)
        return cls(column, row, layer.heads, layer.kv_heads, d, qkv_layout)
