"""DeepSpeed 0.18.2's ZeRO-2 with gradient_accumulation_steps k > 1 steps on the last micro-batch's
gradient alone, divided by k, instead of the mean of the k (deepspeedai/DeepSpeed#7718, "Incorrect
gradient computation in ZeRO-2 with DeepSpeed >= 0.17.6", fixed in 0.18.3). Standalone: one gloo
CPU rank, no suite.

Where (0.18.2, runtime/zero/stage_1_and_2.py, independent_gradient_partition_epilogue): a
micro-batch's gradients are added to the accumulated ones only ``if i in self.averaged_gradients``
and it is not None, a list set at the boundary alone, so before it every micro-batch replaces
``all_grad_tensors[i]`` instead of adding to it; 0.18.3 tests ``all_grad_tensors`` instead.

Prints the distance of DeepSpeed's parameters after one step from one-process SGD stepped with the
mean of the micro-batches' gradients and with the last one over k, and exits 0 when DeepSpeed
matches the latter exactly and not the former (reproduced; on 0.18.3 it matches the mean: exit 1).

    python tests/libraries/deepspeed_zero2_accumulation_keeps_the_last_micro_batch.py   # in a venv with deepspeed
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

K = 2  # gradient_accumulation_steps


def micro_batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(1, 3, generator=generator), torch.randn(1, 1, generator=generator)) for _ in range(K)]


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 1))


def loss_of(forward, x, y):
    return ((forward(x) - y) ** 2).mean()


def one_process(combine) -> list:
    """One SGD step on ``combine`` of the k micro-batches' gradients."""
    net = model()
    grads = []
    for x, y in micro_batches():
        net.zero_grad()
        loss_of(net, x, y).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    for i, p in enumerate(net.parameters()):
        p.grad = combine([g[i] for g in grads])
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    return [p.detach() for p in net.parameters()]


def rank_main(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import deepspeed

    net = model()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": K,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 2},
    }
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), config=config)
    for x, y in micro_batches():  # DeepSpeed's loop: backward and step per micro-batch, the update at the boundary
        engine.backward(loss_of(engine, x, y))
        engine.step()
    results[0] = ([p.detach().clone() for p in net.parameters()], deepspeed.__version__)
    dist.destroy_process_group()


def main() -> int:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(29500 + os.getpid() % 1000, results), nprocs=1)
        got, version = results[0]
    distance = {
        "the mean of the micro-batches' gradients": one_process(lambda gs: sum(gs) / K),
        f"the last micro-batch's gradient over {K}": one_process(lambda gs: gs[-1] / K),
    }
    distance = {what: max((a - b).abs().max().item() for a, b in zip(got, want)) for what, want in distance.items()}
    for what, d in distance.items():
        print(f"DeepSpeed {version} ZeRO-2, gradient_accumulation_steps {K}: distance from one process stepped on {what}: {d:.3g}")
    mean, last = distance.values()
    reproduced = last == 0 and mean > 0
    print("reproduced: only the last micro-batch was stepped on" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
