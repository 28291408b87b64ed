"""DeepSpeed's ZeRO-3, and ZeRO-1 and ZeRO-2 with the optimizer offloaded, step a parameter that no
forward used in a step with the gradient it had in the last step that used it. One process steps
nothing (``.grad`` is None), and DeepSpeed's own documented design for an unused parameter is a zero
gradient (what ZeRO-0, ZeRO-1 and ZeRO-2 without offload do: tests/libraries/
deepspeed_unused_parameter_moves.py); here AdamW is handed the earlier gradient again, so the
parameter moves as if that step had used it. Standalone: gloo CPU ranks, no suite.

Where (0.19.8): ZeRO-3's gradient partitions live in one flat buffer (stage3.py,
``grad_partitions_flat_buffer``, a slice per parameter in ``__param_id_to_grad_partition``). A
backward writes the slice of each parameter that got a gradient (``partition_grads``: ``if
self.micro_step_id == 0: grad_buffer.copy_(grad_partition)``), and the epilogue hands the optimizer
every trainable parameter's slice (``self.averaged_gradients[i] = [self.__param_id_to_grad_partition
[param.ds_id] if param.requires_grad else ...]``), while ``zero_grad`` resets only ``param.grad`` and
``micro_step_id``: the slice of a parameter that this step did not reach still holds its last
gradient. The offloaded ZeRO-1/2 path keeps its CPU gradient partitions the same way.

Prints, for the parameter used on odd steps only, its distance after the steps from three one-process
twins (its .grad None on the steps that skip it, zero there, or the last gradient again) and exits 0
when DeepSpeed matches the last-gradient twin exactly and neither of the others (reproduced).

    python tests/libraries/deepspeed_stale_gradient_of_a_skipped_parameter.py STAGE [offload]   # in a venv with deepspeed
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, STEPS = 2, 3


class SkipsEvenSteps(torch.nn.Module):
    """``sometimes`` is used on the first, third, ... call of forward only."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(2, 2)
        self.sometimes = torch.nn.Linear(2, 2, bias=False)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.used(x)
        if self.calls % 2 == 1:
            h = h + self.sometimes(h)
        return h.square().mean()


def one_process(skipped: str) -> torch.Tensor:
    """One process's AdamW on the same data; on a step that skips ``sometimes`` its gradient is
    None ("none"), zeros ("zero") or the last one it had ("last")."""
    torch.manual_seed(0)
    model = SkipsEvenSteps()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    last = None
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        model(torch.ones(1, 2)).backward()
        weight = model.sometimes.weight
        if weight.grad is not None:
            last = weight.grad.clone()
        elif skipped != "none":
            weight.grad = torch.zeros_like(weight) if skipped == "zero" else last.clone()
        optimizer.step()
    return model.sometimes.weight.detach()


def rank_main(rank: int, port: int, stage: int, offload: bool, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import deepspeed

    torch.manual_seed(0)
    model = SkipsEvenSteps()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,  # the client's torch AdamW, as above
        "zero_optimization": zero,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    for _ in range(STEPS):
        engine.backward(engine(torch.ones(1, 2)))
        engine.step()
    with deepspeed.zero.GatheredParameters(list(model.sometimes.parameters())):
        results[rank] = model.sometimes.weight.detach().clone()
    dist.destroy_process_group()


def main() -> int:
    stage = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    offload = sys.argv[2:3] == ["offload"]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(29500 + os.getpid() % 1000, stage, offload, results), nprocs=WORLD)
        got = [results[r] for r in range(WORLD)]
    distance = {twin: max((g - one_process(twin)).abs().max().item() for g in got) for twin in ("none", "zero", "last")}
    what = f"ZeRO stage {stage}{' with the optimizer offloaded' if offload else ''}, {WORLD} ranks, {STEPS} AdamW steps"
    for twin, d in distance.items():
        print(f"{what}: the skipped parameter's distance from one process stepping it with its gradient {twin} on skipped steps: {d:.3g}")
    reproduced = distance["last"] == 0 and distance["none"] > 0 and distance["zero"] > 0
    print("reproduced: the skipped steps reused its last gradient" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
