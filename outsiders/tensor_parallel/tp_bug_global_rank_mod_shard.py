"""The shard index is computed as the global rank modulo the group size, which is the group rank only for groups of consecutive ranks starting at a multiple of n.

verdict: fail
capability: tensor_parallel

Megatron builds its tensor-parallel groups from consecutive ranks, so tutorials and home-grown
process-group managers often write `tp_rank = global_rank % tp_size` instead of asking the group
(`dist.get_rank(group)`).  On the whole world, or on a mesh row such as [2, 3], the formula gives
the right index and every test passes; on a group such as [0, 2] both members take shard 0, and on
[1, 2] the two shards are swapped, so the weights a rank keeps, the slice it cuts from its input
and the slice it keeps of a gathered gradient no longer match the position its data has in the
group's collectives.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist


class _Group:
    """The process group as a list of global ranks, with this process's tensor-parallel rank."""

    def __init__(self, group):
        self.group = group
        if group is None:
            self.ranks = list(range(dist.get_world_size()))
        else:
            self.ranks = list(dist.get_process_group_ranks(group))
        self.size = len(self.ranks)
        self.rank = dist.get_rank() % self.size


def _exchange(pg, outgoing):
    """outgoing[j] goes to member j; returns incoming, incoming[j] the piece member j sent here."""
    me = dist.get_rank()
    incoming = [None] * pg.size
    ops, keep = [], []
    for j, peer in enumerate(pg.ranks):
        if peer == me:
            incoming[j] = outgoing[j]
            continue
        buf = torch.empty(outgoing[j].shape, dtype=outgoing[j].dtype, device=outgoing[j].device)
        incoming[j] = buf
        ops.append(dist.P2POp(dist.irecv, buf, peer, pg.group))
    for j, peer in enumerate(pg.ranks):
        if peer == me:
            continue
        t = outgoing[j].contiguous()
        keep.append(t)
        ops.append(dist.P2POp(dist.isend, t, peer, pg.group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return incoming


def _ordered_sum(parts):
    out = parts[0].clone()
    for p in parts[1:]:
        out.add_(p)
    return out


def _all_reduce(t, pg):
    if pg.size == 1:
        return t
    return _ordered_sum(_exchange(pg, [t] * pg.size))


def _all_gather(t, pg, dim):
    if pg.size == 1:
        return t
    return torch.cat(_exchange(pg, [t] * pg.size), dim=dim)


def _reduce_scatter(t, pg, dim):
    if pg.size == 1:
        return t
    return _ordered_sum(_exchange(pg, list(t.chunk(pg.size, dim=dim)))).contiguous()


def _split(t, pg, dim):
    if pg.size == 1:
        return t
    return t.chunk(pg.size, dim=dim)[pg.rank].contiguous()


class _F(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.pg), None


class _G(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, pg):
        return _all_reduce(x, pg)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _FSeq(torch.autograd.Function):
    """f under sequence parallelism: all-gather along the sequence, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _all_gather(x, pg, -2)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.pg, -2), None


class _GSeq(torch.autograd.Function):
    """g under sequence parallelism: reduce-scatter along the sequence, all-gather backward."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _reduce_scatter(x, pg, -2)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.pg, -2), None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _all_gather(x, pg, -1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.pg, -1), None


class _ScatterLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _split(x, pg, -1)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.pg, -1), None


def _param(t):
    return nn.Parameter(t.detach().clone(memory_format=torch.contiguous_format))


class ColumnParallelLinear(nn.Module):
    """Rows r of W and the same block of b; f before the matmul, optional all-gather after."""

    def __init__(self, weight, bias, pg, gather_output=False, sequence_parallel=False):
        super().__init__()
        self.pg = pg
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.weight = _param(weight)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = _param(bias)

    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        pg = _Group(group)
        out_features = linear.weight.shape[0]
        if out_features % pg.size != 0:
            raise ValueError(
                f"out_features={out_features} is not divisible by the group size n={pg.size}")
        k = out_features // pg.size
        rows = slice(pg.rank * k, (pg.rank + 1) * k)
        bias = None if linear.bias is None else linear.bias[rows]
        return cls(linear.weight[rows], bias, pg, gather_output=gather_output)

    def forward(self, x):
        if self.sequence_parallel:
            x = _FSeq.apply(x, self.pg)
        else:
            x = _F.apply(x, self.pg)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = _GatherLast.apply(y, self.pg)
        return y


class RowParallelLinear(nn.Module):
    """Columns r of W and the whole b; g after the matmul, b added once after g."""

    def __init__(self, weight, bias, pg, input_is_parallel=True, sequence_parallel=False):
        super().__init__()
        self.pg = pg
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = _param(weight)
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = _param(bias)

    @classmethod
    def from_dense(cls, linear, group=None, input_is_parallel=True):
        pg = _Group(group)
        in_features = linear.weight.shape[1]
        if in_features % pg.size != 0:
            raise ValueError(
                f"in_features={in_features} is not divisible by the group size n={pg.size}")
        k = in_features // pg.size
        cols = slice(pg.rank * k, (pg.rank + 1) * k)
        return cls(linear.weight[:, cols], linear.bias, pg, input_is_parallel=input_is_parallel)

    def forward(self, x):
        if not self.input_is_parallel:
            x = _ScatterLast.apply(x, self.pg)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = _GSeq.apply(y, self.pg)
        else:
            y = _G.apply(y, self.pg)
        if self.bias is not None:
            b = _F.apply(self.bias, self.pg) if self.sequence_parallel else self.bias
            y = y + b
        return y


class TensorParallelMLP(nn.Module):
    """fc1 column parallel, exact GELU, fc2 row parallel; optionally sequence parallel."""

    def __init__(self, fc1, fc2, sequence_parallel=False):
        super().__init__()
        self.fc1 = fc1
        self.fc2 = fc2
        self.sequence_parallel = sequence_parallel

    @classmethod
    def from_dense(cls, fc1, fc2, group=None, sequence_parallel=False):
        pg = _Group(group)
        ffn = fc1.weight.shape[0]
        if ffn % pg.size != 0:
            raise ValueError(f"ffn={ffn} is not divisible by the group size n={pg.size}")
        col = ColumnParallelLinear.from_dense(fc1, group=group, gather_output=False)
        row = RowParallelLinear.from_dense(fc2, group=group, input_is_parallel=True)
        col.sequence_parallel = sequence_parallel
        row.sequence_parallel = sequence_parallel
        return cls(col, row, sequence_parallel=sequence_parallel)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))
