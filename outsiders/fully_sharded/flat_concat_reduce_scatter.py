"""The gradient reduce-scatter runs on the plain concatenation of each parameter's padded full gradient, so rank r receives the r-th block of that concatenation rather than its own piece of every parameter.
verdict: fail
capability: fully_sharded

Comes from the textbook picture of ZeRO-3 as "one flat buffer, reduce-scatter it" applied to the
gradients, while the all-gather in forward uses the rank-major layout (each rank's pieces side by
side). The two layouts agree only when a unit has a single parameter of its dtype, or with one
rank, so a quick test on a bias-free layer passes; with a weight and a bias, each shard's .grad
holds another rank's slice (or another parameter's) of the averaged gradient.
"""
import math

import torch
import torch.distributed as dist
from torch import nn

_LIVE = {}      # storage data_ptr of a forward-gathered full tensor -> (unit state, index)


class _UnitState:
    def __init__(self, group):
        self.group = group
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.entries = []       # dicts: shard, shape, numel, chunk, sites [(module, attr)]
        self.buckets = []       # (dtype, [entry indices], offsets, slot)
        self.bwd_full = None
        self.hooks_ctx = None
        self.live_keys = []

    def build_buckets(self):
        by_dtype = {}
        for i, e in enumerate(self.entries):
            by_dtype.setdefault(e["shard"].dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            offs, s = [], 0
            for i in idx:
                offs.append(s)
                s += self.entries[i]["chunk"]
            self.buckets.append((dtype, idx, offs, s))

    @torch.no_grad()
    def gather(self, shards):
        full = [None] * len(self.entries)
        for dtype, idx, offs, slot in self.buckets:
            mine = torch.cat([shards[i].reshape(-1) for i in idx])
            out = torch.empty(self.n * slot, dtype=dtype, device=mine.device)
            dist.all_gather_into_tensor(out, mine, group=self.group)
            grid = out.view(self.n, slot)
            for i, off in zip(idx, offs):
                e = self.entries[i]
                full[i] = grid[:, off:off + e["chunk"]].reshape(-1)[:e["numel"]].view(e["shape"]).clone()
        return full

    @torch.no_grad()
    def reduce(self, grads):
        out_grads = [None] * len(self.entries)
        for dtype, idx, offs, slot in self.buckets:
            dev = self.entries[idx[0]]["shard"].device
            flat = torch.zeros(self.n * slot, dtype=dtype, device=dev)
            pos = 0
            for i in idx:
                e = self.entries[i]
                g = grads[i]
                if g is not None:
                    flat[pos:pos + e["numel"]].copy_(g.reshape(-1))
                pos += self.n * e["chunk"]
            mine = torch.empty(slot, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(mine, flat, group=self.group)
            mine.div_(self.n)
            for i, off in zip(idx, offs):
                if grads[i] is not None:
                    out_grads[i] = mine[off:off + self.entries[i]["chunk"]].clone()
        return out_grads

    def backward_full(self):
        if self.bwd_full is None:
            self.bwd_full = self.gather([e["shard"].detach() for e in self.entries])
        return self.bwd_full


class _GatherUnit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, *shards):
        ctx.state = state
        ctx.set_materialize_grads(False)
        return tuple(state.gather(shards))

    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state
        shard_grads = state.reduce(grads)
        state.bwd_full = None
        return (None, *shard_grads)


def _pack(t):
    if not _LIVE:
        return t
    try:
        key = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return t
    hit = _LIVE.get(key)
    if hit is None:
        return t
    state, i = hit
    return (_Handle, state, i, t.size(), t.stride(), t.storage_offset())


class _Handle:
    pass


def _unpack(p):
    if isinstance(p, tuple) and len(p) == 6 and p[0] is _Handle:
        _, state, i, size, stride, offset = p
        return state.backward_full()[i].as_strided(size, stride, offset)
    return p


def _pre_forward(module, args):
    state = module._fs_state
    if not state.entries:
        return None
    full = _GatherUnit.apply(state, *[e["shard"] for e in state.entries])
    if not isinstance(full, tuple):
        full = (full,)
    for e, t in zip(state.entries, full):
        for mod, attr in e["sites"]:
            mod.__dict__[attr] = t
    if torch.is_grad_enabled():
        state.live_keys = [t.untyped_storage().data_ptr() for t in full]
        for i, k in enumerate(state.live_keys):
            _LIVE[k] = (state, i)
        state.hooks_ctx = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        state.hooks_ctx.__enter__()
    return None


def _post_forward(module, args, output):
    state = module._fs_state
    if not state.entries:
        return None
    if state.hooks_ctx is not None:
        state.hooks_ctx.__exit__(None, None, None)
        state.hooks_ctx = None
    for k in state.live_keys:
        _LIVE.pop(k, None)
    state.live_keys = []
    for e in state.entries:
        for mod, attr in e["sites"]:
            mod.__dict__.pop(attr, None)
    return None


def _walk(module):
    """Modules of ``module``'s subtree that no inner unit holds (the module itself included)."""
    yield module
    for child in module.children():
        if hasattr(child, "_fs_state"):
            continue
        yield from _walk(child)


def fully_shard(module, group=None):
    if hasattr(module, "_fs_state"):
        return module
    state = _UnitState(group)
    n, rank = state.n, state.rank
    by_param = {}
    for mod in _walk(module):
        for attr, p in mod._parameters.items():
            if p is None or not p.requires_grad:
                continue
            by_param.setdefault(id(p), (p, []))[1].append((mod, attr))
    for p, sites in by_param.values():
        numel = p.numel()
        chunk = max(1, math.ceil(numel / n))
        with torch.no_grad():
            padded = torch.zeros(n * chunk, dtype=p.dtype, device=p.device)
            padded[:numel].copy_(p.detach().reshape(-1))
            shard = nn.Parameter(padded[rank * chunk:(rank + 1) * chunk].clone(), requires_grad=True)
        for mod, attr in sites:
            mod._parameters[attr] = shard
        state.entries.append({"shard": shard, "shape": p.shape, "numel": numel,
                              "chunk": chunk, "sites": sites})
    state.build_buckets()
    module._fs_state = state
    module.register_forward_pre_hook(_pre_forward)
    module.register_forward_hook(_post_forward)
    return module


def _find_entry(module):
    found = {}
    for mod in module.modules():
        st = getattr(mod, "_fs_state", None)
        if st is None:
            continue
        for i, e in enumerate(st.entries):
            found[id(e["shard"])] = (st, i)
    return found


@torch.no_grad()
def full_parameters(module):
    owners = _find_entry(module)
    result = {}
    for name, p in module.named_parameters():
        hit = owners.get(id(p))
        if hit is None:
            result[name] = p.detach().clone()
            continue
        st, i = hit
        e = st.entries[i]
        out = torch.empty(st.n * e["chunk"], dtype=p.dtype, device=p.device)
        dist.all_gather_into_tensor(out, p.detach().contiguous(), group=st.group)
        result[name] = out[:e["numel"]].view(e["shape"]).clone()
    return result
