"""DeepSpeed gives a parameter that no forward used a zero gradient, so AdamW (weight decay, or
momentum from an earlier step) moves it, where one process (and torch's DDP) leaves ``.grad``
None and the optimizer skips it. Standalone: 2 gloo CPU ranks, no suite.

ZeRO stage 0: engine._get_gradients_for_reduction sets ``param.grad = torch.zeros(...)`` for every
trainable parameter without one ("In cases where there is an imbalance of empty grads across
ranks we must create empty grads", runtime/engine.py); ZeRO-3 reduces a zero gradient for it too.
Prints what it saw and exits 0 when an unused parameter moved (the behaviour is reproduced).

    python tests/libraries/deepspeed_unused_parameter_moves.py [stage]   # in a venv with deepspeed
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(2, 1)
        self.unused = torch.nn.Linear(2, 1)  # never called

    def forward(self, x):
        return self.used(x).square().mean()


def rank_main(rank: int, port: int, stage: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import deepspeed

    torch.manual_seed(0)
    model = TwoHeads()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    with deepspeed.zero.GatheredParameters(list(model.unused.parameters())):
        before = model.unused.weight.detach().clone()
    loss = engine(torch.ones(1, 2))
    engine.backward(loss)
    grad = None if model.unused.weight.grad is None else model.unused.weight.grad.abs().max().item()
    engine.step()
    with deepspeed.zero.GatheredParameters(list(model.unused.parameters())):
        moved = (model.unused.weight.detach() - before).abs().max().item()
    results[rank] = (grad, moved)
    dist.destroy_process_group()


def main() -> int:
    stage = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    port = 29500 + os.getpid() % 1000
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(port, stage, results), nprocs=2)
        for rank in (0, 1):
            grad, moved = results[rank]
            print(
                f"ZeRO stage {stage}, rank {rank}: the unused parameter's .grad after backward: "
                f"{'None' if grad is None else f'max |g| = {grad}'}; moved by the step: {moved:.3g} (one process: 0)"
            )
        reproduced = all(results[r][1] > 0 for r in (0, 1))
    print("reproduced: a parameter no forward used was updated" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
