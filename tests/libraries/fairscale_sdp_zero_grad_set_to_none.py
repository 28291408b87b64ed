"""fairscale's ShardedDataParallel trains wrong once its optimizer's ``zero_grad(set_to_none=True)``
(torch 2's default) has run: from the second step on the parameters leave one process's
trajectory. Standalone: 2 gloo CPU ranks, no suite; fairscale 0.4.13, torch 2.13.

SDP keeps each ``.grad`` as a view into its reduce bucket; setting it to None drops the view, the
next backward's gradient is a fresh tensor, and what SDP reduces to the owner is the bucket
(upstream: facebookresearch/fairscale#354, "[ShardedDDP] Intercept zero_grad()": "with set_to_none
positive, this will break the buckets tensor views", closed without the fix reaching OSS.zero_grad).
The same loop with ``zero_grad(set_to_none=False)`` or ``sdp.zero_grad()`` follows one process
exactly. Prints the largest parameter difference per step for both and exits 0 when set_to_none=True
diverges and set_to_none=False does not (the bug is reproduced).

    python tests/libraries/fairscale_sdp_zero_grad_set_to_none.py   # in a venv with fairscale
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 3


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Tanh(), torch.nn.Linear(1, 1))


def rank_main(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from fairscale.nn import ShardedDataParallel
    from fairscale.optim import OSS

    for set_to_none in (True, False):
        model, one_process = build(), build()
        optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.05)
        sdp = ShardedDataParallel(model, optimizer)
        reference = torch.optim.SGD(one_process.parameters(), lr=0.05)
        data = torch.Generator().manual_seed(1)
        for step in range(STEPS):
            x, y = torch.randn(2, 1, generator=data), torch.randn(2, 1, generator=data)
            optimizer.zero_grad(set_to_none=set_to_none)
            reference.zero_grad()
            ((sdp(x[rank : rank + 1]) - y[rank : rank + 1]) ** 2).mean().backward()  # this rank's half of the batch
            ((one_process(x) - y) ** 2).mean().backward()  # the whole batch
            optimizer.step()
            reference.step()
            results[(set_to_none, rank, step)] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), one_process.parameters()))
    dist.destroy_process_group()


def main() -> int:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(29600 + os.getpid() % 300, results), nprocs=2)
        for set_to_none in (True, False):
            errors = [results[(set_to_none, 0, s)] for s in range(STEPS)]
            print(
                f"zero_grad(set_to_none={set_to_none}): largest difference from one process after each step: "
                + ", ".join(f"{e:.3g}" for e in errors)
            )
        diverged = results[(True, 0, STEPS - 1)] > 1e-3 and max(results[(False, r, s)] for r in (0, 1) for s in range(STEPS)) < 1e-6
    print("reproduced: set_to_none=True diverges, set_to_none=False does not" if diverged else "not reproduced")
    return 0 if diverged else 1


if __name__ == "__main__":
    sys.exit(main())
