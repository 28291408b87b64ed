"""How many bytes each rank sends: the communication cost model of CS336 lecture 7, as per-rank
upper bounds the communication audit (harness/driver/audit.py) checks recorded traffic against.

Notation: a group of ``n`` ranks; a message of ``numel`` elements of ``itemsize`` bytes,
S = numel * itemsize. Every bound is an exact integer: where the data splits into n chunks that
need not be equal (numel not divisible by n; torch.tensor_split sizes, differing by at most one),
the bound is that of the worst chunk a rank may keep, so rounding is part of the formula, never a
tolerance. Bytes are tensor payload only: transport headers are not in the records nor in the
theory.

Collectives (bandwidth-optimal algorithms; Patarasuk & Yuan, JPDC 2009, for the rings; Thakur,
Rabenseifner & Gropp, IJHPCA 2005, for the trees):

* all-reduce (ring: reduce-scatter then all-gather): 2 (n-1)/n S. A rank sends every chunk but
  one in each of the two phases, so at most 2 (numel - floor(numel/n)) items: less than two items
  above 2 (n-1)/n S. This is also the lower bound for any all-reduce (Patarasuk & Yuan, sec. 3),
  so an implementation that sends more per rank is not bandwidth optimal.
* reduce-scatter, S the input: (n-1)/n S, at most numel - floor(numel/n) items.
* all-gather, S the output: (n-1)/n S, at most numel_out - floor(numel_out/n) items.
* broadcast (binomial tree): a rank sends the whole message to each of its children, and the
  root, which has the most, has ceil(log2 n); the bound is ceil(log2 n) S for every rank (the
  scatter + all-gather broadcast, 2 (n-1)/n S, is within it too). The n-1 messages sum to (n-1) S.
* reduce (binomial tree): every non-root sends its partial result once: S; the root sends
  nothing. The bound is S for every rank (Rabenseifner's reduce-scatter + gather also sends
  (n-1)/n S + S/n = S per non-root).
* scatter: the root sends every piece but its own, (n-1)/n S (S the whole list); a tree forwards
  fewer per rank. gather: the mirror image, at most (n-1)/n S per rank (linear: S/n per non-root).
* all-to-all: what the rank holds for the other ranks, sum_{j != me} split_j (pairwise exchange).

Training (per step):

* data parallelism: one all-reduce of every gradient that needs one, none for frozen parameters:
  2 (n-1)/n G, G the bytes of the trainable parameters. Bucketing changes the rounding only:
  with B buckets of whole parameters, B <= P (the number of trainable tensors), the rings send at
  most 2 (n-1)/n (G_items + B) items, bounded by 2 (n-1)/n (G_items + P).
* tensor parallelism (Megatron MLP, column then row): one all-reduce of the activation [..., h] in
  forward (g, after the row layer) and one in backward (f, dL/dx before the column layer), each
  2 (n-1)/n A; a column-parallel layer without gather_output communicates nothing in forward. With
  sequence parallelism each all-reduce becomes an all-gather plus a reduce-scatter, the same bytes.
* pipeline parallelism: per microbatch and stage boundary one activation forward and one gradient
  backward; a stage sends M activations (unless last) and M gradients (unless first).

Pure integer arithmetic: never imports torch.distributed (nor torch).
"""

from __future__ import annotations

import math

COLLECTIVES = (
    "broadcast",
    "reduce",
    "all_reduce",
    "scatter",
    "gather",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
)


def _check(n: int, *sizes: int) -> None:
    if n < 1:
        raise ValueError(f"group size must be at least 1, got {n}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"sizes must be non-negative, got {sizes}")


def ring_phase(n: int, numel: int, itemsize: int) -> int:
    """Bytes one rank sends in one ring phase (reduce-scatter or all-gather) over ``numel`` items
    split in n chunks: every chunk but one, at most (numel - floor(numel/n)) * itemsize, which is
    (n-1)/n S when n divides numel."""
    _check(n, numel, itemsize)
    return (numel - numel // n) * itemsize


def all_reduce(n: int, numel: int, itemsize: int) -> int:
    """Ring all-reduce: 2 (n-1)/n S per rank (two ring phases)."""
    return 2 * ring_phase(n, numel, itemsize)


def reduce_scatter(n: int, input_numel: int, itemsize: int) -> int:
    """Ring reduce-scatter, S = the input (all n chunks): (n-1)/n S per rank."""
    return ring_phase(n, input_numel, itemsize)


def all_gather(n: int, output_numel: int, itemsize: int) -> int:
    """Ring all-gather, S = the gathered output: (n-1)/n S per rank."""
    return ring_phase(n, output_numel, itemsize)


def tree_rounds(n: int) -> int:
    """ceil(log2 n): the rounds of a binomial tree over n ranks (0 for one rank)."""
    _check(n)
    return math.ceil(math.log2(n)) if n > 1 else 0


def broadcast(n: int, numel: int, itemsize: int) -> int:
    """Binomial-tree broadcast: at most ceil(log2 n) S per rank (the root's sends)."""
    _check(n, numel, itemsize)
    return tree_rounds(n) * numel * itemsize


def reduce(n: int, numel: int, itemsize: int) -> int:
    """Binomial-tree reduce: every non-root sends its partial S once; the bound is S per rank."""
    _check(n, numel, itemsize)
    return numel * itemsize if n > 1 else 0


def scatter(n: int, piece_numel: int, itemsize: int) -> int:
    """Scatter of n pieces: (n-1)/n S = (n-1) pieces per rank (the root's sends)."""
    _check(n, piece_numel, itemsize)
    return (n - 1) * piece_numel * itemsize


def gather(n: int, piece_numel: int, itemsize: int) -> int:
    """Gather of n pieces: at most (n-1)/n S = (n-1) pieces per rank (a tree's busiest forwarder;
    linear gather: one piece per non-root)."""
    return scatter(n, piece_numel, itemsize)


def all_to_all(split_bytes: list[int], me: int) -> int:
    """All-to-all: the bytes this rank (group rank ``me``) holds for the others."""
    _check(len(split_bytes), *split_bytes)
    return sum(split_bytes) - split_bytes[me]


def data_parallel_step(n: int, trainable_numels: list[int], itemsize: int) -> int:
    """Per rank per step: 2 (n-1)/n of the trainable gradients (frozen parameters excluded), plus
    the rounding of at most one ring per trainable tensor: floor(2 (n-1) (G_items + P) / n) items.

    Derivation: a bucket of m items costs 2 (m - floor(m/n)) <= 2 (n-1)/n m + 2 (n-1)/n items, and
    there are at most P buckets (each holds at least one whole parameter)."""
    _check(n, itemsize, *trainable_numels)
    items = sum(trainable_numels) + len(trainable_numels)
    return (2 * (n - 1) * items // n) * itemsize


def balanced_shard(numels: list[int], n: int) -> int:
    """Items of the fullest of n shards made of whole tensors, assigned largest first to the
    least-loaded shard (Graham's LPT rule, 1969; within 4/3 of the best split): the shard size a
    whole-parameter ZeRO design reaches, and at least the ceil(P/n) of an even flat split."""
    _check(n, *numels)
    loads = [0] * n
    for numel in sorted(numels, reverse=True):
        loads[loads.index(min(loads))] += numel
    return max(loads)


def sharded_optimizer_step(n: int, trainable_numels: list[int], itemsize: int) -> int:
    """ZeRO stage 1 (Rajbhandari et al., 2020, sec. 7.2.1: "the same communication volume as
    baseline DP"): per rank per step, a reduce-scatter of the gradients and an all-gather of the
    updated parameters over n shards of B items, (n-1) B items apiece: 2 (n-1) B itemsize with
    B = balanced_shard(trainable_numels, n), against data parallelism's 2 (n-1) P_items / n."""
    _check(n, itemsize, *trainable_numels)
    if not trainable_numels:
        return 0
    return 2 * (n - 1) * balanced_shard(trainable_numels, n) * itemsize


def data_parallel_reduced_bytes(trainable_bytes: list[int]) -> int:
    """What one step reduces: every trainable gradient once, G = sum of their bytes."""
    return sum(trainable_bytes)


def tensor_parallel_mlp(n: int, activation_numel: int, itemsize: int) -> dict[str, int]:
    """Megatron MLP, per rank: {"forward": one all-reduce of the activation (g), "backward": one
    all-reduce of dL/dx (f)}, each 2 (n-1)/n A."""
    per_pass = all_reduce(n, activation_numel, itemsize)
    return {"forward": per_pass, "backward": per_pass}


def sequence_parallel_mlp(n: int, activation_numel: int, bias_numel: int, itemsize: int) -> dict[str, int]:
    """Megatron MLP with sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2), per rank, with
    the activation A split evenly along the sequence: forward, an all-gather of x and a
    reduce-scatter of the output, (n-1)/n A each, one all-reduce's bytes together; backward, the
    same pair for the gradients, plus an all-reduce of the row layer's bias gradient (b2, replicated
    while each rank's dL/db2 sums over its own sequence shard only)."""
    pair = reduce_scatter(n, activation_numel, itemsize) + all_gather(n, activation_numel, itemsize)
    return {"forward": pair, "backward": pair + all_reduce(n, bias_numel, itemsize)}


def column_parallel(n: int, input_numel: int, itemsize: int) -> dict[str, int]:
    """Column-parallel linear without gather_output, per rank: nothing forward (f is the identity),
    one all-reduce of dL/dx backward."""
    return {"forward": 0, "backward": all_reduce(n, input_numel, itemsize)}


def expert_parallel_moe(
    routed: list[list[int]], me: int, hidden: int, itemsize: int, num_experts: int, count_itemsize: int = 8
) -> dict[str, int]:
    """Top-1 MoE with experts split over n ranks, per rank (group rank ``me``): ``routed[s][d]`` is
    the number of tokens of rank s whose expert lives on rank d. Forward: the per-expert token
    counts to every other rank (at most (n-1) E counts), the tokens leaving this rank
    (sum_{d != me} routed[me][d] rows of ``hidden``) and the results of the tokens that came in
    (sum_{s != me} routed[s][me] rows) going back; backward: the same two token exchanges with their
    directions swapped, so the same bytes. Tokens routed to this rank's own experts never move."""
    n = len(routed)
    _check(n, hidden, itemsize, num_experts, *(c for row in routed for c in row))
    row = hidden * itemsize
    tokens = (sum(routed[me]) - routed[me][me] + sum(r[me] for r in routed) - routed[me][me]) * row
    return {"forward": (n - 1) * num_experts * count_itemsize + tokens, "backward": tokens}


def pipeline_stage(stages: int, stage: int, microbatches: int, activation_bytes: int, gradient_bytes: int | None = None) -> dict[str, int]:
    """Pipeline parallelism, what stage ``stage`` (0-based) of ``stages`` sends per step: one
    activation per microbatch forward unless it is the last stage, one gradient (the activation's
    size unless given) backward unless it is the first."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not one of {stages} stages")
    _check(stages, microbatches, activation_bytes)
    gradient_bytes = activation_bytes if gradient_bytes is None else gradient_bytes
    return {
        "forward": microbatches * activation_bytes if stage < stages - 1 else 0,
        "backward": microbatches * gradient_bytes if stage > 0 else 0,
    }


def sharded_numel(n: int, numel: int, rows: int) -> int:
    """Elements of a parameter of ``numel`` elements and ``rows`` rows once padded for n ranks: to a
    multiple of n elements (flat sharding) or of n rows (dim-0 sharding, as FSDP2 does), the larger."""
    return max(-(-numel // n) * n, -(-rows // n) * n * (numel // max(rows, 1)))


def fully_sharded_step(
    n: int,
    unit_numels: list[list[tuple[int, int]]],
    itemsize: int,
    gathers: int = 2,
    frozen_numels: list[list[tuple[int, int]]] | None = None,
    reduce_itemsize: int | None = None,
) -> int:
    """One forward and backward of a model whose units hold the trainable parameters
    ``unit_numels[u]`` = [(numel, rows), ...]: each unit's parameters all-gathered at most twice
    (before forward, again before backward after resharding) and their gradients reduce-scattered
    once (Zhao et al., "PyTorch FSDP", 2023, sec. 3; ZeRO-3's 1.5x DP traffic, Rajbhandari et al.
    2020, sec. 7). A parameter is padded to a multiple of n elements, or of n rows (dim-0 sharding,
    as FSDP2 does), whichever is larger. ``gathers=1``: units not resharded after forward
    (FSDP2's ``reshard_after_forward=False``, ZeRO-2's traffic: the all-gather and reduce-scatter
    halves of one all-reduce, Rajbhandari et al. 2020, sec. 7). ``frozen_numels[u]``: unit u's
    frozen parameters, which an implementation may shard too (FSDP2 does: they are all-gathered
    with the rest, never reduce-scattered). ``reduce_itemsize``: the gradients' element size when it
    differs from the gathered parameters' (a compute dtype: parameters gathered in it, gradients
    reduce-scattered in it or in the masters' dtype, at most ``reduce_itemsize``)."""
    frozen_numels = frozen_numels or [[] for _ in unit_numels]
    total = 0
    for unit, frozen in zip(unit_numels, frozen_numels, strict=True):
        trainable = sum(sharded_numel(n, numel, rows) for numel, rows in unit)
        gathered = trainable + sum(sharded_numel(n, numel, rows) for numel, rows in frozen)
        total += gathers * all_gather(n, gathered, itemsize) + reduce_scatter(n, trainable, reduce_itemsize or itemsize)
    return total


def ring_attention(block_bytes: list[int], me: int) -> dict[str, int]:
    """Ring attention (Liu et al. 2023) on n ranks whose K/V blocks (K and V together) hold
    ``block_bytes[j]`` bytes at group rank j: forward, group rank ``me`` passes on every block it
    holds except the last it receives, its successor's, (n-1) blocks in all: sum_{j != me+1} B_j.
    Backward, the larger of two designs: blocks kept from forward, each block's gradient (the same
    size) going back the way it came, sum_{j != me} B_j; or one block held at a time (the paper's
    memory-efficient backward, and ring-flash-attention's), the K/V blocks passed around the ring
    again, (n-1) blocks, with their gradients riding along and taking one more hop home, n blocks:
    sum_{j != me+1} B_j + sum_j B_j. (An implementation written from the contract alone took the
    second, and the first bound failed it.)"""
    n = len(block_bytes)
    _check(n, *block_bytes)
    if n == 1:
        return {"forward": 0, "backward": 0}
    total = sum(block_bytes)
    forward = total - block_bytes[(me + 1) % n]
    return {"forward": forward, "backward": max(total - block_bytes[me], forward + total)}


def collective(name: str, n: int, me: int, *, numel: int, itemsize: int, split_bytes: list[int] | None = None) -> int:
    """The per-rank bound of one call of collective ``name`` (torch.distributed's name) on a group of
    n ranks, for group rank ``me``. ``numel``: the elements of the call's data as this module's
    functions take them (all_reduce/broadcast/reduce: the tensor; reduce_scatter*: the whole input;
    all_gather*: the whole output; scatter/gather: one piece); all_to_all*: ``split_bytes``."""
    if name == "all_reduce":
        return all_reduce(n, numel, itemsize)
    if name == "broadcast":
        return broadcast(n, numel, itemsize)
    if name == "reduce":
        return reduce(n, numel, itemsize)
    if name in ("reduce_scatter", "reduce_scatter_tensor"):
        return reduce_scatter(n, numel, itemsize)
    if name in ("all_gather", "all_gather_into_tensor"):
        return all_gather(n, numel, itemsize)
    if name == "scatter":
        return scatter(n, numel, itemsize)
    if name == "gather":
        return gather(n, numel, itemsize)
    if name in ("all_to_all", "all_to_all_single"):
        return all_to_all(split_bytes, me)
    raise ValueError(f"no cost model for {name!r} (known: {', '.join(COLLECTIVES)})")
