"""Correct: FSDP2-style per-parameter dim-0 sharding, one batched all-gather / reduce-scatter per unit
verdict: pass
capability: fully_sharded

Each parameter a unit manages (those of its module tree not held by an inner unit) is padded along
dim 0 to a multiple of the world size n and split into n equal row blocks; the rank keeps its block
as a plain nn.Parameter registered under the original name, so the optimizer only ever sees this
rank's pieces. A forward pre-hook all-gathers every managed parameter of the unit in one collective
(the shards are concatenated, gathered rank-major, and copied out per parameter with the padding
dropped) into persistent "unsharded" leaf Parameters that are swapped into the module for the
forward. After the forward the sharded Parameters are swapped back and, with
reshard_after_forward=True, the unsharded storages are freed (resize to 0); a hook on the forward's
outputs gathers them again, into the same storages, right before the unit's backward needs them.
The unit's post-backward (an autograd function wrapped around its tensor inputs, or the root's
end-of-backward callback for units whose inputs need no gradient) reduce-scatters the unsharded
gradients of the parameters that got one, in one collective, divides by n and accumulates into the
sharded .grad (so several backwards accumulate, unused parameters keep None), then frees the
gathered parameters. reshard_after_forward=False (ZeRO-2 traffic) keeps them from forward to backward.
"""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

_ATTR = "_fs2_unit"


def _group_of(group):
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    return dist.new_group(ranks=sorted(group))


class _Param:
    """One managed parameter: its places in the module tree, its shard and its gathered copy."""

    def __init__(self, param, locations, rank, world):
        self.locations = locations
        self.full_shape = param.shape
        self.dtype = param.dtype
        self.requires_grad = param.requires_grad
        self.d0 = param.shape[0] if param.dim() > 0 else 1
        self.rest = tuple(param.shape[1:]) if param.dim() > 0 else ()
        self.row = math.prod(self.rest)
        self.world = world
        self.chunk = -(-self.d0 // world)
        self.shard_numel = self.chunk * self.row
        with torch.no_grad():
            rows = param.detach().reshape(self.d0, self.row)
            padded = rows.new_zeros(self.chunk * world, self.row)
            padded[: self.d0].copy_(rows)
            mine = padded[rank * self.chunk:(rank + 1) * self.chunk].reshape((self.chunk,) + self.rest).clone()
        self.sharded = nn.Parameter(mine, requires_grad=param.requires_grad)
        self.unsharded = None

    def alloc_unsharded(self):
        if self.unsharded is None:
            self.unsharded = nn.Parameter(torch.empty(self.full_shape, dtype=self.dtype),
                                          requires_grad=self.requires_grad)
        else:
            st = self.unsharded.untyped_storage()
            need = self.unsharded.numel() * self.unsharded.element_size()
            if st.size() != need:
                st.resize_(need)
        return self.unsharded

    def free_unsharded(self):
        if self.unsharded is not None:
            self.unsharded.untyped_storage().resize_(0)

    def place(self, tensor):
        for mod, name in self.locations:
            mod._parameters[name] = tensor

    def padded_rows(self, full):
        """full (full shape) -> [world, shard_numel], zero padding at the end."""
        rows = full.reshape(self.d0, self.row)
        pad = self.chunk * self.world - self.d0
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, self.row)], dim=0)
        return rows.reshape(self.world, self.shard_numel)


class _PostBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, unit, *inputs):
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.post_backward()
        return (None,) + grads


class _Unit:
    def __init__(self, module, group, reshard_after_forward):
        self.module = module
        self.group = _group_of(group)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.reshard_after_forward = reshard_after_forward
        self.params = self._collect(module)
        self.is_root = None
        self.root = None
        self.all_units = []
        self.unsharded = False
        self.needs_post_backward = False
        self.callback_queued = False

    def _collect(self, module):
        inner = set()
        for m in module.modules():
            u = getattr(m, _ATTR, None)
            if u is not None and m is not module:
                inner.update(id(p.sharded) for p in u.params)
        found = {}
        order = []
        seen = set()

        def visit(m, top):
            if id(m) in seen:
                return
            seen.add(id(m))
            if not top and getattr(m, _ATTR, None) is not None:
                return
            for name, p in m._parameters.items():
                if p is None or id(p) in inner:
                    continue
                if id(p) not in found:
                    found[id(p)] = (p, [])
                    order.append(id(p))
                found[id(p)][1].append((m, name))
            for c in m.children():
                visit(c, False)

        visit(module, True)
        params = []
        for key in order:
            p, locs = found[key]
            fp = _Param(p, locs, self.rank, self.world)
            fp.place(fp.sharded)
            params.append(fp)
        return params

    def _by_dtype(self, items, key):
        groups = {}
        for it in items:
            groups.setdefault(key(it).dtype, []).append(it)
        return list(groups.values())

    # ---------------------------------------------------------------- gather / scatter
    def unshard(self):
        if self.unsharded:
            return
        for grp in self._by_dtype(self.params, lambda p: p.sharded):
            with torch.no_grad():
                inp = torch.cat([p.sharded.detach().reshape(-1) for p in grp])
                out = torch.empty(self.world * inp.numel(), dtype=inp.dtype)
                dist.all_gather_into_tensor(out, inp, group=self.group)
                out = out.view(self.world, inp.numel())
                off = 0
                for p in grp:
                    full = p.alloc_unsharded()
                    piece = out[:, off:off + p.shard_numel].reshape(self.world * p.chunk, p.row)[: p.d0]
                    full.data.copy_(piece.reshape(p.full_shape))
                    off += p.shard_numel
        self.unsharded = True

    def reshard(self):
        for p in self.params:
            p.free_unsharded()
        self.unsharded = False

    def post_backward(self):
        if not self.needs_post_backward:
            return
        self.needs_post_backward = False
        pairs = [(p, p.unsharded.grad) for p in self.params
                 if p.unsharded is not None and p.unsharded.grad is not None]
        for grp in self._by_dtype(pairs, lambda pg: pg[1]):
            with torch.no_grad():
                inp = torch.cat([p.padded_rows(g) for p, g in grp], dim=1).reshape(-1)
                out = torch.empty(inp.numel() // self.world, dtype=inp.dtype)
                dist.reduce_scatter_tensor(out, inp, group=self.group)
                out.div_(self.world)
                off = 0
                for p, _ in grp:
                    piece = out[off:off + p.shard_numel].reshape((p.chunk,) + p.rest)
                    off += p.shard_numel
                    s = p.sharded
                    if s.grad is None:
                        s.grad = piece.clone()
                    else:
                        s.grad.add_(piece)
        for p in self.params:
            if p.unsharded is not None:
                p.unsharded.grad = None
        self.reshard()

    # ------------------------------------------------------------------------- hooks
    def lazy_init(self):
        if self.is_root is not None:
            return
        self.is_root = True
        self.root = self
        self.all_units = []
        for m in self.module.modules():
            u = getattr(m, _ATTR, None)
            if u is not None and u not in self.all_units:
                self.all_units.append(u)
                if u is not self:
                    u.is_root = False
                    u.root = self

    def pre_forward(self, module, args, kwargs):
        self.lazy_init()
        if self.is_root:
            # anything left gathered by a forward that never had a backward is stale now
            for u in self.all_units:
                if u.unsharded:
                    u.reshard()
                u.needs_post_backward = False
        self.unshard()
        for p in self.params:
            p.place(p.unsharded)
        if torch.is_grad_enabled() and self.params:
            self.needs_post_backward = True
            flat, spec = tree_flatten((args, kwargs))
            idx = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
            if idx:
                outs = _PostBackward.apply(self, *[flat[i] for i in idx])
                for i, t in zip(idx, outs):
                    flat[i] = t
                args, kwargs = spec.unflatten(flat)
        return args, kwargs

    def post_forward(self, module, args, kwargs, output):
        for p in self.params:
            p.place(p.sharded)
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.reshard()
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self.pre_backward)
        return output

    def pre_backward(self, grad):
        root = self.root or self
        if not root.callback_queued:
            root.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(root.final_callback)
        if self.needs_post_backward:
            self.unshard()
        return grad

    def final_callback(self):
        self.callback_queued = False
        for u in self.all_units:
            if u.needs_post_backward:
                u.post_backward()
            if u.unsharded:
                u.reshard()


def fully_shard(module, group=None, reshard_after_forward=True):
    unit = _Unit(module, group, reshard_after_forward)
    setattr(module, _ATTR, unit)
    module.register_forward_pre_hook(unit.pre_forward, with_kwargs=True)
    module.register_forward_hook(unit.post_forward, with_kwargs=True)
    return module


def full_parameters(module):
    owner = {}
    for m in module.modules():
        u = getattr(m, _ATTR, None)
        if u is not None:
            for p in u.params:
                owner[id(p.sharded)] = (u, p)
                if p.unsharded is not None:
                    owner[id(p.unsharded)] = (u, p)
    result = {}
    for name, param in module.named_parameters():
        hit = owner.get(id(param))
        if hit is None:
            result[name] = param.detach().clone()
            continue
        u, p = hit
        with torch.no_grad():
            inp = p.sharded.detach().reshape(-1).contiguous()
            out = torch.empty(u.world * inp.numel(), dtype=inp.dtype)
            dist.all_gather_into_tensor(out, inp, group=u.group)
            full = out.view(u.world * p.chunk, p.row)[: p.d0].reshape(p.full_shape).clone()
        result[name] = full
    return result
