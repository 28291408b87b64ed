"""DeepSpeed's engine does not make the ranks' buffers rank 0's (torch's DDP does, at construction
and, with broadcast_buffers=True, at every forward). Standalone: 2 gloo CPU ranks, no suite.

Each rank registers a buffer of its own value; after deepspeed.initialize the parameters are rank
0's (engine._broadcast_model broadcasts ``self.module.named_parameters()``, runtime/engine.py) and
the buffers are still each rank's own. Prints one line per rank and exits 0 when that is what it
saw (the behaviour is reproduced), 1 otherwise.

    python tests/libraries/deepspeed_buffers_not_broadcast.py   # in a venv with deepspeed
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import deepspeed

    torch.manual_seed(rank)  # every rank starts from its own values: the engine should make them rank 0's
    model = torch.nn.Linear(2, 1)
    model.register_buffer("offset", torch.full((1,), float(rank + 1)))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}
    deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    weight = model.weight.detach().clone()
    dist.broadcast(weight, 0)
    results[rank] = (bool(torch.equal(weight, model.weight.detach())), model.offset.item())
    dist.destroy_process_group()


def main() -> int:
    port = 29500 + os.getpid() % 1000
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(port, results), nprocs=2)
        for rank in (0, 1):
            same, offset = results[rank]
            print(f"rank {rank}: parameters are rank 0's: {same}; buffer 'offset' = {offset} (rank 0's is 1.0)")
        reproduced = all(results[r][0] for r in (0, 1)) and results[1][1] != results[0][1]
    print("reproduced: the parameters are broadcast, the buffers are not" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
