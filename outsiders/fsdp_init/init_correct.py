"""Correct: flat element-chunk FSDP (autograd gather / reduce-scatter per unit) with meta-device init_sharded that draws each submodule whole on CPU and keeps the rank's chunk
verdict: pass
capability: fsdp_init

Cut: every parameter a unit manages (the parameters of its module tree not already held by an inner
unit; a tied parameter is managed once and all its slots point at the same piece) is flattened and
cut into n contiguous element chunks of c = ceil(numel / n) elements; rank r keeps elements
[r*c, min((r+1)*c, numel)) as a 1-D nn.Parameter registered under the original name (so the last
ranks may hold a shorter or an empty piece, and no padding is ever stored: padding lives only in
the collective buffers). model.parameters() therefore yields only this rank's pieces. A piece is
recognised by a flag set on the piece object itself (never by id(), which Python reuses once an
older model's pieces are freed), so every rank cuts the same parameters into the same units.

Forward: a pre-hook calls one autograd Function per unit whose forward all-gathers every managed
parameter of the unit in one all_gather_into_tensor per dtype (chunks padded to c and concatenated,
gathered rank-major, copied out per parameter into a fresh contiguous full tensor) and whose
backward reduce-scatters the gradients in one reduce_scatter_tensor per dtype (SUM, then divided
by n) whose layout is fixed by the unit alone: every trainable parameter of the dtype with a
non-empty chunk always has its slot (zeros where no gradient arrived), so every rank makes the same
calls whatever its piece holds (an empty piece included). Each rank's chunk is returned as the
gradient of its piece: autograd's AccumulateGrad adds it to .grad (gradient accumulation), and a
parameter no forward used gets None from autograd and keeps .grad None. Frozen parameters are gathered too but marked
non-differentiable. The full tensors are placed in the module's _parameters slots for the forward
and the pieces are put back by a post-hook. With reshard_after_forward=True, saved-tensor hooks are
active during the unit's forward: a saved tensor sharing storage with a gathered full tensor is
packed as a token (unit, index, size, stride, offset), so nothing keeps the full weights after the
forward; the first unpack in backward all-gathers the unit again (one collective) into a cache that
the unit's Function backward (or, failing that, an end-of-backward engine callback) drops.

init_sharded(module, seed, device): meta pieces, meta unmanaged parameters and meta buffers are
first replaced by zeros on `device` (real ones are moved there). Then, with torch's default CPU
generator seeded by `seed` (torch.default_generator.manual_seed, the CPU part of torch.manual_seed,
so no CUDA generator is touched), for every submodule in module.modules() order that has a
callable reset_parameters, each of its direct parameters is swapped for a zero-filled full-shaped
CPU tensor of the parameter's dtype, reset_parameters() is called, the original pieces are put back
and this rank's chunk of each full tensor is copied into its piece. Every rank draws every
parameter whole (the CPU generator cannot skip ahead), so the pieces are the single process's
draws. reset_parameters is assumed to touch only the module's own parameters (true of torch's
layers). The generator's state is saved first and restored at the end, even on error, so the
caller's stream goes on. No collective is used by init_sharded.
"""
from torch.distributed import *  # noqa: F401,F403  (torch.distributed's own names)

import torch
import torch.nn as nn
import torch.distributed as dist


# --------------------------------------------------------------------------------------------
# per-parameter and per-unit state
# --------------------------------------------------------------------------------------------
class _ParamInfo:
    def __init__(self, param, slots, n, rank):
        self.slots = slots                      # [(module, name)] holding this parameter
        self.shape = tuple(param.shape)
        self.numel = param.numel()
        self.dtype = param.dtype
        self.requires_grad = param.requires_grad
        self.chunk = (self.numel + n - 1) // n if self.numel else 0
        self.start = min(rank * self.chunk, self.numel)
        self.length = min(self.start + self.chunk, self.numel) - self.start
        self.sharded = None

    def put(self, tensor):
        for m, name in self.slots:
            m._parameters[name] = tensor

    def set_sharded(self, param):
        self.sharded = param
        self.put(param)


class _Token:
    __slots__ = ("state", "index", "size", "stride", "offset")

    def __init__(self, state, index, size, stride, offset):
        self.state = state
        self.index = index
        self.size = size
        self.stride = stride
        self.offset = offset


# storage data_ptr of a gathered full tensor (live during its unit's forward) -> (state, index)
_REGISTRY = {}
# attribute set on every sharded piece, so an outer unit never shards an inner unit's piece again
# (a flag on the object, not a set of id()s: ids of freed pieces are reused by later parameters)
_PIECE_FLAG = "_fsdp_init_piece"


def _mark_piece(param):
    setattr(param, _PIECE_FLAG, True)
    return param


def _is_piece(param):
    return getattr(param, _PIECE_FLAG, False) is True


def _pack(t):
    if _REGISTRY:
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception:
            return t
        hit = _REGISTRY.get(ptr) if ptr else None
        if hit is not None:
            state, i = hit
            if t.dtype == state.infos[i].dtype:
                return _Token(state, i, tuple(t.size()), tuple(t.stride()), t.storage_offset())
    return t


def _unpack(x):
    if isinstance(x, _Token):
        full = x.state.backward_full()[x.index]
        return full.as_strided(x.size, x.stride, x.offset)
    return x


class _UnitState:
    def __init__(self, module, group, reshard, infos):
        self.module = module
        self.group = group
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.reshard = reshard
        self.infos = infos
        self.dtype_groups = {}
        for i, info in enumerate(infos):
            self.dtype_groups.setdefault(info.dtype, []).append(i)
        self.bwd_full = None
        self.hooks_ctx = []
        self.registered = []

    # ---- collectives ------------------------------------------------------------------------
    def gather(self, pieces):
        n = self.n
        fulls = [None] * len(self.infos)
        for dtype, idxs in self.dtype_groups.items():
            device = pieces[idxs[0]].device
            total = sum(self.infos[i].chunk for i in idxs)
            if total == 0:
                for i in idxs:
                    fulls[i] = torch.empty(self.infos[i].shape, dtype=dtype, device=device)
                continue
            send = torch.zeros(total, dtype=dtype, device=device)
            off = 0
            for i in idxs:
                info = self.infos[i]
                if info.length:
                    send[off:off + info.length].copy_(pieces[i].detach().reshape(-1))
                off += info.chunk
            out = torch.empty(n * total, dtype=dtype, device=device)
            dist.all_gather_into_tensor(out, send, group=self.group)
            mat = out.view(n, total)
            off = 0
            for i in idxs:
                info = self.infos[i]
                full = torch.empty(info.shape, dtype=dtype, device=device)
                if info.numel:
                    full.view(-1).copy_(mat[:, off:off + info.chunk].reshape(-1)[:info.numel])
                fulls[i] = full
                off += info.chunk
            del out, mat, send
        return fulls

    def reduce_scatter(self, grads):
        n = self.n
        result = [None] * len(self.infos)
        for dtype, idxs in self.dtype_groups.items():
            # the layout depends on the unit only (never on which gradients arrived on this rank
            # nor on what this rank's piece holds), so every rank makes the same call
            slots = [i for i in idxs if self.infos[i].requires_grad and self.infos[i].chunk]
            for i in idxs:  # empty parameters that got a gradient get an empty one
                if self.infos[i].requires_grad and grads[i] is not None and not self.infos[i].chunk:
                    result[i] = torch.zeros(0, dtype=dtype, device=grads[i].device)
            if not slots:
                continue
            device = self.infos[slots[0]].sharded.device
            total = sum(self.infos[i].chunk for i in slots)
            buf = torch.zeros(n, total, dtype=dtype, device=device)
            off = 0
            for i in slots:
                info = self.infos[i]
                if grads[i] is not None:
                    padded = torch.zeros(n * info.chunk, dtype=dtype, device=device)
                    padded[:info.numel].copy_(grads[i].reshape(-1))
                    buf[:, off:off + info.chunk].copy_(padded.view(n, info.chunk))
                off += info.chunk
            out = torch.empty(total, dtype=dtype, device=device)
            dist.reduce_scatter_tensor(out, buf.view(-1), op=dist.ReduceOp.SUM, group=self.group)
            out.div_(n)
            off = 0
            for i in slots:
                info = self.infos[i]
                if grads[i] is not None:  # no gradient arrived here: .grad stays as it was
                    result[i] = out[off:off + info.length].clone()
                off += info.chunk
            del buf, out
        return result

    def backward_full(self):
        if self.bwd_full is None:
            with torch.no_grad():
                self.bwd_full = self.gather([info.sharded for info in self.infos])
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._drop_backward_full)
            except Exception:
                pass
        return self.bwd_full

    def _drop_backward_full(self):
        self.bwd_full = None


class _GatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, *pieces):
        ctx.state = state
        ctx.set_materialize_grads(False)
        fulls = state.gather(pieces)
        frozen = [f for f, info in zip(fulls, state.infos) if not info.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(fulls)

    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state
        state.bwd_full = None  # the unit's backward is over: free the re-gathered weights
        return (None, *state.reduce_scatter(list(grads)))


# --------------------------------------------------------------------------------------------
# hooks
# --------------------------------------------------------------------------------------------
def _pre_forward(module, args):
    st = module._fsdp_unit_state
    if not st.infos:
        return None
    pieces = [info.sharded for info in st.infos]
    grad_on = torch.is_grad_enabled() and any(p.requires_grad for p in pieces)
    if grad_on:
        fulls = list(_GatherFn.apply(st, *pieces))
    else:
        with torch.no_grad():
            fulls = st.gather(pieces)
    for info, full in zip(st.infos, fulls):
        info.put(full)
    if grad_on and st.reshard:
        keys = []
        for i, full in enumerate(fulls):
            ptr = full.untyped_storage().data_ptr() if full.numel() else 0
            if ptr:
                _REGISTRY[ptr] = (st, i)
                keys.append(ptr)
        st.registered.append(keys)
        ctx = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        ctx.__enter__()
        st.hooks_ctx.append(ctx)
    else:
        st.registered.append(None)
        st.hooks_ctx.append(None)
    return None


def _post_forward(module, args, output):
    st = module._fsdp_unit_state
    if not st.infos:
        return None
    for info in st.infos:
        info.put(info.sharded)
    if st.hooks_ctx:
        ctx = st.hooks_ctx.pop()
        keys = st.registered.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)
        for k in keys or ():
            _REGISTRY.pop(k, None)
    return None


# --------------------------------------------------------------------------------------------
# the contract's functions
# --------------------------------------------------------------------------------------------
def fully_shard(module, group=None, reshard_after_forward=True):
    if getattr(module, "_fsdp_unit_state", None) is not None:
        return module
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)

    found = {}          # id(param) -> (param, slots)
    order = []
    seen_modules = set()

    def walk(m, top):
        if id(m) in seen_modules:
            return
        seen_modules.add(id(m))
        if not top and getattr(m, "_fsdp_unit_state", None) is not None:
            return
        for name, p in m._parameters.items():
            if p is None or _is_piece(p):
                continue
            if id(p) not in found:
                found[id(p)] = (p, [])
                order.append(id(p))
            found[id(p)][1].append((m, name))
        for child in m._modules.values():
            if child is not None:
                walk(child, False)

    walk(module, True)

    infos = []
    for pid in order:
        p, slots = found[pid]
        info = _ParamInfo(p, slots, n, rank)
        with torch.no_grad():
            piece = p.detach().reshape(-1)[info.start:info.start + info.length].clone()
        sharded = _mark_piece(nn.Parameter(piece, requires_grad=p.requires_grad))
        info.set_sharded(sharded)
        infos.append(info)

    module._fsdp_unit_state = _UnitState(module, group, reshard_after_forward, infos)
    module.register_forward_pre_hook(_pre_forward)
    module.register_forward_hook(_post_forward, always_call=True)
    return module


def _piece_infos(module):
    infos = {}
    for m in module.modules():
        st = getattr(m, "_fsdp_unit_state", None)
        if st is not None:
            for info in st.infos:
                infos[id(info.sharded)] = (st, info)
    return infos


def full_parameters(module):
    infos = _piece_infos(module)
    out = {}
    for name, p in module.named_parameters():
        hit = infos.get(id(p))
        if hit is None:
            out[name] = p.detach().clone()
            continue
        st, info = hit
        if info.chunk == 0:
            out[name] = torch.empty(info.shape, dtype=info.dtype, device=p.device)
            continue
        send = torch.zeros(info.chunk, dtype=info.dtype, device=p.device)
        send[:info.length].copy_(p.detach())
        gathered = torch.empty(st.n * info.chunk, dtype=info.dtype, device=p.device)
        dist.all_gather_into_tensor(gathered, send, group=st.group)
        out[name] = gathered[:info.numel].view(info.shape).clone()
    return out


def _materialise(t, device, param):
    if t.is_meta:
        new = torch.zeros(t.shape, dtype=t.dtype, device=device)
    elif t.device != device:
        new = t.detach().to(device)
    else:
        return t
    return nn.Parameter(new, requires_grad=t.requires_grad) if param else new


def init_sharded(module, seed, device=None):
    device = torch.device("cpu") if device is None else torch.device(device)
    generator = torch.default_generator
    saved_state = generator.get_state()
    try:
        # 1. storage on `device` for pieces, unmanaged parameters and buffers
        for st in [getattr(m, "_fsdp_unit_state", None) for m in module.modules()]:
            if st is None:
                continue
            for info in st.infos:
                new = _materialise(info.sharded, device, param=True)
                if new is not info.sharded:
                    info.set_sharded(_mark_piece(new))
        infos = _piece_infos(module)
        replaced = {}
        for m in module.modules():
            for name, p in list(m._parameters.items()):
                if p is None or id(p) in infos:
                    continue
                if id(p) not in replaced:
                    replaced[id(p)] = _materialise(p, device, param=True)
                m._parameters[name] = replaced[id(p)]
            for name, b in list(m._buffers.items()):
                if b is not None:
                    m._buffers[name] = _materialise(b, device, param=False)

        # 2. one process's draws, submodule by submodule, whole on CPU; keep this rank's chunk
        generator.manual_seed(seed)
        for m in module.modules():
            reset = getattr(m, "reset_parameters", None)
            if not callable(reset):
                continue
            own = []
            temps = {}
            for name, p in m._parameters.items():
                if p is None:
                    continue
                if id(p) not in temps:
                    hit = infos.get(id(p))
                    info = hit[1] if hit is not None else None
                    shape = info.shape if info is not None else tuple(p.shape)
                    full = torch.zeros(shape, dtype=p.dtype, device="cpu")
                    temps[id(p)] = (p, info, nn.Parameter(full, requires_grad=p.requires_grad))
                own.append((name, p))
            for name, p in own:
                m._parameters[name] = temps[id(p)][2]
            try:
                reset()
            finally:
                for name, p in own:
                    m._parameters[name] = p
            with torch.no_grad():
                for p, info, tmp in temps.values():
                    flat = tmp.detach().reshape(-1)
                    if info is not None:
                        p.copy_(flat[info.start:info.start + info.length])
                    else:
                        p.copy_(tmp.detach())
    finally:
        generator.set_state(saved_state)
    return module
