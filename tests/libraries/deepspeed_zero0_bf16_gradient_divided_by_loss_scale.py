"""DeepSpeed 0.18.5 under ``bf16`` at ZeRO stage 0, without the suite: the step divides every gradient
by 65536 (deepspeedai/DeepSpeed#7837, fixed by #7839 in the next release). bf16 at stage 0 runs on
FP16_UnfusedOptimizer, whose dynamic loss scale starts at 2^16; ``engine.backward`` does not scale a
bf16 loss, but ``step`` unscales the gradients by the scale all the same, so SGD moves each weight by
lr * g / 65536 instead of lr * g.

One gloo rank, a 1x2 linear layer holding [1, -1], input [1, 2], the loss the output's sum (its
gradient [1, 2]), SGD(lr=1/8) without weight decay: one step should leave [0.875, -1.25] in the
float32 masters. Printed with the model's bf16 copy.

Exits 0 when the masters moved by lr * g / 65536 (the bug is reproduced), 1 when they moved by lr * g.

    python tests/libraries/deepspeed_zero0_bf16_gradient_divided_by_loss_scale.py   # in a venv with deepspeed
"""

import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import deepspeed

    net = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[1.0, -1.0]]))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0, "bf16": {"enabled": True}}
    engine, optimizer, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.125), config=config)
    loss = engine(torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)).sum()
    engine.backward(loss)
    engine.step()
    master = optimizer.fp32_groups[0][0].detach().reshape(-1)
    expected, divided = torch.tensor([0.875, -1.25]), torch.tensor([1.0, -1.0]) - 0.125 * torch.tensor([1.0, 2.0]) / 65536
    print(
        f"DeepSpeed {deepspeed.__version__} bf16 ZeRO-0 ({type(optimizer).__name__}): after one SGD step the masters are "
        f"{master.tolist()} (the model's bf16 copy {net.weight.detach().float().reshape(-1).tolist()}); lr * g gives "
        f"{expected.tolist()}, lr * g / 65536 gives {divided.tolist()}"
    )
    dist.destroy_process_group()
    reproduced = torch.allclose(master, divided, rtol=0, atol=1e-7)
    print("reproduced: the gradient was divided by 65536" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
