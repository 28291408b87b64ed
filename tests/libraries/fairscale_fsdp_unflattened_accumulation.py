"""fairscale 0.4.13's FullyShardedDataParallel with ``flatten_parameters=False`` and two backward passes
before a step (gradient accumulation without ``no_sync``), on 2 gloo CPU ranks, without the suite.
With the default ``flatten_parameters=True`` the step is one process's on the global batch (the
mean over ranks of the summed micro-batch gradients); unflattened it is not.

An MLP 1-1-1 (Linear, tanh, Linear) under one seed, nested as fairscale's users nest it (each Linear
its own FSDP inside the root's), SGD(lr=0.5), each rank 2 micro-batches of one sample.

fairscale's FSDP orders CUDA side streams even with ``compute_device=cpu``; a CPU torch refuses those
calls, so this script stands them in with no-ops first (CPU kernels run in program order), as
adapters/fairscale_cpu.py does for the suite: ``torch.cuda.current_stream``/``stream``/``Stream``/
``synchronize`` in fairscale's FSDP module, the instance's ``_streams`` dict, and
``Tensor.record_stream`` on a CPU tensor. None changes what is computed or sent.

Prints what it saw and exits 0 when the unflattened step is off one process's while the flattened one
matches (the behaviour is reproduced), 1 otherwise.

    python tests/libraries/fairscale_fsdp_unflattened_accumulation.py   # in a venv with fairscale
"""

import contextlib
import os
import sys
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MICRO_BATCHES, LR = 2, 0.5


class _Stream:
    def wait_stream(self, stream):
        return None

    def synchronize(self):
        return None


def cpu_streams() -> None:
    from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp

    stream = _Stream()
    cuda = types.SimpleNamespace(**{n: getattr(torch.cuda, n) for n in dir(torch.cuda) if not n.startswith("__")})
    cuda.current_stream, cuda.stream, cuda.Stream = (lambda device=None: stream), (lambda s=None: contextlib.nullcontext()), _Stream
    cuda.synchronize = lambda device=None: None
    namespace = types.SimpleNamespace(**{n: getattr(torch, n) for n in dir(torch) if not n.startswith("__")})
    namespace.cuda = cuda
    fsdp.torch = namespace

    class Streams(dict):
        def __missing__(self, name):
            return stream

    init = fsdp.FullyShardedDataParallel.__init__

    def init_on_cpu(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._streams = Streams()

    fsdp.FullyShardedDataParallel.__init__ = init_on_cpu
    record = torch.Tensor.record_stream
    torch.Tensor.record_stream = lambda t, s: None if isinstance(s, _Stream) else record(t, s)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Tanh(), torch.nn.Linear(1, 1))


def sample(rank: int, j: int):
    g = torch.Generator().manual_seed(10 * rank + j)
    return torch.randn(1, 1, generator=g), torch.randn(1, 1, generator=g)


def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ENABLE_NCCL_BASE_COLLECTIVES="0")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cpu_streams()
    from fairscale.nn import FullyShardedDataParallel as FSDP

    for flatten in (True, False):
        net = model()
        options = {"compute_device": torch.device("cpu"), "flatten_parameters": flatten}
        net[0], net[2] = FSDP(net[0], **options), FSDP(net[2], **options)
        root = FSDP(net, **options)
        optimizer = torch.optim.SGD(root.parameters(), lr=LR)
        optimizer.zero_grad()
        for j in range(MICRO_BATCHES):
            x, y = sample(rank, j)
            torch.nn.functional.mse_loss(root(x), y).backward()
        optimizer.step()
        with root.summon_full_params():
            state = {name: p.detach().clone() for name, p in root.named_parameters()}
        if rank == 0:
            out[flatten] = state
    dist.destroy_process_group()


def one_process() -> dict:
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for rank in range(2):
        for j in range(MICRO_BATCHES):
            x, y = sample(rank, j)
            (torch.nn.functional.mse_loss(net(x), y) / 2).backward()  # the mean over ranks, summed over micro-batches
    optimizer.step()
    return [p.detach() for p in net.parameters()]


def main() -> int:
    import fairscale

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(rank_main, args=(29500 + os.getpid() % 1000, out), nprocs=2)
        out = dict(out)
    want = one_process()
    off = {}
    for flatten, state in out.items():
        got = list(state.values())
        off[flatten] = max((a.reshape(-1) - b.reshape(-1)).abs().max().item() for a, b in zip(got, want))
        print(
            f"fairscale {fairscale.__version__} FSDP, flatten_parameters={flatten}, {MICRO_BATCHES} backwards a step: "
            f"off one process by {off[flatten]:.3g} ({', '.join(f'{n} {v.reshape(-1).tolist()}' for n, v in state.items())})"
        )
    print(f"one process: {[w.reshape(-1).tolist() for w in want]}")
    reproduced = off[True] < 1e-6 and off[False] > 1e-3
    print("reproduced: unflattened FSDP accumulates two backwards wrong" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
