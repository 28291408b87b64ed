"""DeepSpeed (0.19.8) under ``bf16`` or ``fp16`` at ZeRO stage 0, without the suite: ``initialize``
steps the client's optimizer once with zero gradients before any training step.
``FP16_UnfusedOptimizer.__init__`` calls ``initialize_optimizer_states``, which sets every gradient to
zero and calls ``self.optimizer.step()`` (runtime/fp16/unfused_optimizer.py). A zero gradient does not
make that step inert: SGD's weight decay adds wd * p to it, and AdamW decays p by (1 - lr wd) and
counts a step, so the first real step's bias correction is step 2's. ZeRO stages 1-3 no longer step at
initialize (DeepSpeed#5104), nor does BF16_Optimizer (#6485); bf16 at stage 0 was routed to
FP16_UnfusedOptimizer by #7515.

One gloo rank, a 1x2 linear layer holding [1, -1]: after ``initialize`` (no forward, no backward) the
float32 masters DeepSpeed steps should still be [1, -1]; with SGD(lr=1/8, weight_decay=1/4) they are
[0.96875, -0.96875], and AdamW's state counts one step. float32 training (no flag) steps nothing.

Prints what it saw and exits 0 when both flags decay the masters at initialize and float32 does not
(the behaviour is reproduced), 1 otherwise.

    python tests/libraries/deepspeed_fp16_optimizer_steps_at_initialize.py   # in a venv with deepspeed
"""

import os
import sys

import torch
import torch.distributed as dist


def masters_after_initialize(flag: dict, optimizer_class, **options):
    import deepspeed

    net = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[1.0, -1.0]]))
    optimizer = optimizer_class(net.parameters(), **options)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0, **flag}
    _, wrapped, _, _ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    groups = getattr(wrapped, "fp32_groups", None)
    master = groups[0][0] if groups else net.weight
    inner = getattr(wrapped, "optimizer", wrapped)
    steps = [int(s["step"]) for s in inner.state.values() if "step" in s]
    return master.detach().float().reshape(-1).tolist(), steps, type(wrapped).__name__


def main() -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import deepspeed

    flags = {"float32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}}
    seen = {}
    for name, flag in flags.items():
        sgd = masters_after_initialize(flag, torch.optim.SGD, lr=0.125, weight_decay=0.25)
        adamw = masters_after_initialize(flag, torch.optim.AdamW, lr=0.125, weight_decay=0.25)
        seen[name] = (sgd[0], adamw[0], adamw[1])
        print(
            f"DeepSpeed {deepspeed.__version__} {name} ({sgd[2]}): after initialize, before any step, the masters are "
            f"{sgd[0]} with SGD(lr=1/8, weight_decay=1/4) and {adamw[0]} with AdamW (its step counts {adamw[1]}); "
            "the model holds [1.0, -1.0]"
        )
    dist.destroy_process_group()
    untouched = [1.0, -1.0]
    reproduced = seen["float32"][0] == untouched and all(seen[f][0] != untouched and seen[f][2] == [1] for f in ("bf16", "fp16"))
    print("reproduced: bf16 and fp16 step the optimizer at initialize" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
