"""nanotron's TensorParallelRowLinear (0.2) keeps its bias on the group's rank 0 only
(parallel/tensor_parallel/nn.py: "No need to shard the bias term, only rank 0 would have it"; the
other ranks' ``bias`` is None) and adds it there before the all-reduce: the output is right, but the
bias and its gradient are not held whole on every rank, as Megatron's and torch's row layers hold them.
Standalone: 2 gloo CPU ranks, no suite.

Prints what each rank holds and exits 0 when rank 1 has no bias and the output equals the dense
layer's (the behaviour is reproduced), 1 otherwise.

    python tests/libraries/nanotron_row_bias_on_rank0.py   # in a venv with nanotron==0.2
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
    from nanotron.parallel.tensor_parallel.nn import TensorParallelRowLinear

    torch.manual_seed(0)
    dense = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)
    layer = TensorParallelRowLinear(4, 3, pg=dist.group.WORLD, mode=TensorParallelLinearMode.ALL_REDUCE, bias=True)
    with torch.no_grad():
        layer.weight.copy_(dense.weight[:, rank * 2 : (rank + 1) * 2])
        if layer.bias is not None:
            layer.bias.copy_(dense.bias)
    y = layer(x[:, rank * 2 : (rank + 1) * 2])
    results[rank] = (layer.bias is not None, bool(torch.allclose(y, dense(x), atol=1e-6)))
    dist.destroy_process_group()


def main() -> int:
    port = 29500 + os.getpid() % 1000
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(port, results), nprocs=2)
        results = dict(results)
    for rank in (0, 1):
        print(f"rank {rank}: holds a bias: {results[rank][0]}; output equals the dense layer's: {results[rank][1]}")
    reproduced = results[0][0] and not results[1][0] and results[0][1] and results[1][1]
    print("reproduced: the bias lives on rank 0 only, the output is right" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
