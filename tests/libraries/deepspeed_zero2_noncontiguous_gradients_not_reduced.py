"""DeepSpeed 0.18.2 to 0.18.6, ZeRO stage 2 with ``contiguous_gradients: false``, on 2 gloo CPU ranks,
without the suite: rank 0 steps fc1.weight (its partition) on its own local gradient, never reduced
with rank 1's, instead of the mean of the two. With the default ``contiguous_gradients: true`` the
same step is one process's step on the global batch; 0.19.8 is right both ways (the release that
fixed it between them is not bisected).

A 2-layer MLP (tanh) under the same seed on both ranks, each rank its own batch of 3, the loss the
mean squared error, SGD(lr=0.2), one step; one process takes the mean of the two ranks' gradients.

Prints what it saw and exits 0 when ``contiguous_gradients: false`` steps on rank 0's own gradient and the
default on the mean (the behaviour is reproduced), 1 otherwise.

    python tests/libraries/deepspeed_zero2_noncontiguous_gradients_not_reduced.py   # in a venv with deepspeed
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LR = 0.2


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(2, 11), torch.nn.Tanh(), torch.nn.Linear(11, 2))


def batch(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(3, 2, generator=g), torch.randn(3, 2, generator=g)


def loss_of(net, rank):
    x, y = batch(rank)
    return torch.nn.functional.mse_loss(net(x), y)


def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import deepspeed

    for contiguous in (True, False):
        net = model()
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 2, "contiguous_gradients": contiguous},
            "zero_allow_untested_optimizer": True,
        }
        engine, _, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR), config=config)
        engine.backward(loss_of(engine, rank))
        engine.step()
        if rank == 0:
            out[contiguous] = (net[0].weight.detach().clone(), deepspeed.__version__)
    dist.destroy_process_group()


def one_process(reduce) -> torch.Tensor:
    """fc1.weight after one SGD step on the ranks' gradients combined by ``reduce`` (mean or sum)."""
    grads = []
    for rank in range(2):
        net = model()
        loss_of(net, rank).backward()
        grads.append(net[0].weight.grad)
    return model()[0].weight.detach() - LR * reduce(torch.stack(grads))


def main() -> int:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(rank_main, args=(29500 + os.getpid() % 1000, out), nprocs=2)
        out = dict(out)
    candidates = {"mean": lambda g: g.mean(0), "sum": lambda g: g.sum(0), "rank 0's own": lambda g: g[0], "rank 1's own": lambda g: g[1]}
    steps = {name: one_process(reduce) for name, reduce in candidates.items()}
    version = out[True][1]
    seen = {}
    for contiguous, (weight, _) in out.items():
        seen[contiguous] = next((name for name, want in steps.items() if torch.allclose(weight, want, rtol=0, atol=1e-6)), "none of them")
        print(
            f"DeepSpeed {version} ZeRO-2, contiguous_gradients={contiguous}: rank 0's fc1.weight after one step is the step on "
            f"{seen[contiguous]} gradient(s) (off the mean's step by {(weight - steps['mean']).abs().max().item():.3g})"
        )
    reproduced = seen[True] == "mean" and seen[False] == "rank 0's own"
    print("reproduced: contiguous_gradients=false steps on rank 0's own gradient" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
