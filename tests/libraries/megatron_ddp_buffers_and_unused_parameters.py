"""megatron-core's DistributedDataParallel (0.16.1) on 2 gloo CPU ranks, without the suite: it does
not make the ranks' buffers rank 0's (``broadcast_params`` broadcasts ``self.module.parameters()``
only, distributed/distributed_data_parallel.py), and a parameter that no forward used gets a gradient
all the same: with ``overlap_grad_reduce=True``, in a step after the first (which records the order in which
gradients arrive), its bucket's reduction is never launched and ``finish_grad_sync`` raises "Communication call has not been issued for this bucket"; without overlap
its ``main_grad`` is zeros, which Megatron's optimizer then hands to the step as ``.grad``
(FP32Optimizer: ``param.grad = param.main_grad``) where one process and torch's DDP keep it None.

Prints what it saw and exits 0 when all three are so (the behaviour is reproduced), 1 otherwise.

    python tests/libraries/megatron_ddp_buffers_and_unused_parameters.py   # in a venv with megatron-core
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Net(torch.nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        self.register_buffer("offset", torch.full((1,), float(rank + 1)))

    def forward(self, x, both=False):
        return self.used(x) + self.offset + (self.unused(x) if both else 0)


def ddp(rank: int, overlap: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(rank)
    config = TransformerConfig(num_layers=1, hidden_size=1, num_attention_heads=1, use_cpu_initialization=True)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=overlap), Net(rank))
    model.broadcast_params()
    return model


def rank_main(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.cuda.current_device = lambda: torch.device("cpu")  # its grad buffers allocate there
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    model = ddp(rank, overlap=True)
    results[f"buffer{rank}"] = model.module.offset.item()
    for both in (True, False):  # a first step that uses both parameters (Megatron records its order), then one
        model.zero_grad_buffer()
        model(torch.ones(1, 2), both).sum().backward()
        if both:
            model.finish_grad_sync()
    try:
        model.finish_grad_sync()
        results[f"overlap{rank}"] = "no error"
    except AssertionError as error:
        results[f"overlap{rank}"] = str(error)
    model = ddp(rank, overlap=False)
    model.zero_grad_buffer()
    model(torch.ones(1, 2)).sum().backward()
    model.finish_grad_sync()
    results[f"unused{rank}"] = (model.module.unused.weight.grad is None, model.module.unused.weight.main_grad.tolist())
    dist.destroy_process_group()


def main() -> int:
    port = 29500 + os.getpid() % 1000
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(port, results), nprocs=2)
        results = dict(results)
    print(f"buffer 'offset' after broadcast_params: rank 0 {results['buffer0']}, rank 1 {results['buffer1']}")
    print(f"overlap_grad_reduce=True, a parameter unused in step 2: finish_grad_sync: {results['overlap0']}")
    print(f"overlap_grad_reduce=False: the unused parameter's .grad is None: {results['unused0'][0]}, its main_grad {results['unused0'][1]}")
    reproduced = (
        results["buffer0"] != results["buffer1"] and "has not been issued" in results["overlap0"] and results["unused0"][1] == [[0.0, 0.0]]
    )
    print(
        "reproduced: buffers not broadcast; an unused parameter stops the overlapped reduction, and gets a zero main_grad without it"
        if reproduced
        else "not reproduced"
    )
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
