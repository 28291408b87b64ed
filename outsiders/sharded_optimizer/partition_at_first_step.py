"""The partition is built lazily at the first step() from the parameters that have a gradient then, so a parameter unused in the first step is never owned, never stepped and never trained.
verdict: fail
capability: sharded_optimizer

Comes from deferring the partition until the first step so it "only counts parameters that really
train" (frozen and idle ones drop out by themselves), a common trick to balance shards by
what actually receives gradients. It is right as long as every parameter is used in the first
step; a parameter that first appears in a later forward is owned by nobody and stays at its
initial value on every rank, whereas one process would start updating it.
"""
from collections import OrderedDict

import torch
import torch.distributed as dist


class ShardedOptimizer:
    def __init__(self, params, optimizer_class, group=None, **defaults):
        self.group = group
        self.world = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        self.optimizer_class = optimizer_class
        self.defaults = dict(defaults)
        self._groups = []          # every param group, all params (as given)
        self._owner = {}           # id(param) -> owning rank (group rank)
        self._order = []           # trainable params in registration order
        self._load = [0] * self.world
        self.optim = None
        self._partitioned = False
        self._layout()
        params = list(params)
        if len(params) == 0:
            raise ValueError("ShardedOptimizer got an empty parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        for g in params:
            self.add_param_group(g)

    # ------------------------------------------------------------------ partition
    def _assign(self, new_params):
        fresh = [p for p in new_params if p.requires_grad and id(p) not in self._owner]
        ranked = sorted(range(len(fresh)), key=lambda i: (-fresh[i].numel(), i))
        for i in ranked:
            p = fresh[i]
            r = min(range(self.world), key=lambda k: (self._load[k], k))
            self._owner[id(p)] = r
            self._load[r] += p.numel()
        self._order.extend(fresh)
        self._layout()

    def _layout(self):
        # per dtype: slot size and every param's offset inside its owner's slot
        self._buckets = OrderedDict()
        for p in self._order:
            key = (p.dtype, p.device)
            b = self._buckets.setdefault(key, {"params": [], "fill": [0] * self.world})
            r = self._owner[id(p)]
            b["params"].append((p, r, b["fill"][r]))
            b["fill"][r] += p.numel()
        for b in self._buckets.values():
            b["slot"] = max(b["fill"])

    def add_param_group(self, param_group):
        g = dict(param_group)
        ps = g["params"]
        if isinstance(ps, torch.Tensor):
            ps = [ps]
        g["params"] = list(ps)
        for k, v in self.defaults.items():
            g.setdefault(k, v)
        self._groups.append(g)
        mine = dict(g)
        mine["params"] = []
        if self.optim is None:
            self.optim = self.optimizer_class([mine], **self.defaults)
        else:
            self.optim.add_param_group(mine)
        if self._partitioned:
            self._claim(len(self._groups) - 1)

    def _claim(self, gi):
        g = self._groups[gi]
        self._assign([p for p in g["params"] if p.grad is not None])
        self.optim.param_groups[gi]["params"] = [
            p for p in g["params"] if self._owner.get(id(p)) == self.me]

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    # ------------------------------------------------------------------ training
    def zero_grad(self, set_to_none=True):
        for g in self._groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    @torch.no_grad()
    def _average_gradients(self):
        n, me = self.world, self.me
        for b in self._buckets.values():
            slot = b["slot"]
            if slot == 0:
                continue
            p0 = b["params"][0][0]
            send = torch.zeros(n * slot, dtype=p0.dtype, device=p0.device)
            for p, r, off in b["params"]:
                if p.grad is not None:
                    send[r * slot + off: r * slot + off + p.numel()].copy_(p.grad.reshape(-1))
            mine = torch.empty(slot, dtype=p0.dtype, device=p0.device)
            dist.reduce_scatter_tensor(mine, send, group=self.group)
            mine.div_(n)
            for p, r, off in b["params"]:
                if r == me and p.grad is not None:
                    p.grad.copy_(mine[off: off + p.numel()].view_as(p.grad))

    @torch.no_grad()
    def _share_parameters(self):
        n, me = self.world, self.me
        for b in self._buckets.values():
            slot = b["slot"]
            if slot == 0:
                continue
            p0 = b["params"][0][0]
            mine = torch.zeros(slot, dtype=p0.dtype, device=p0.device)
            for p, r, off in b["params"]:
                if r == me:
                    mine[off: off + p.numel()].copy_(p.reshape(-1))
            everyone = torch.empty(n * slot, dtype=p0.dtype, device=p0.device)
            dist.all_gather_into_tensor(everyone, mine, group=self.group)
            for p, r, off in b["params"]:
                if r != me:
                    p.copy_(everyone[r * slot + off: r * slot + off + p.numel()].view_as(p))

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._partitioned:
            self._partitioned = True
            for gi in range(len(self._groups)):
                self._claim(gi)
        self._average_gradients()
        self.optim.step()
        self._share_parameters()
        return loss
