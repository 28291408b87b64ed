"""megatron-core's vocab_parallel_cross_entropy (0.16.1) computes in float32 whatever the logits'
dtype: ``calculate_logits_max`` starts with ``vocab_parallel_logits.float()``
(tensor_parallel/cross_entropy.py), so float64 logits give a float32 loss, off the float64 cross
entropy by float32's rounding. For bfloat16/float16 logits that is the point (the loss in float32);
for float64 it is a downcast. One gloo rank, without the suite.

Prints what it saw and exits 0 when the loss is float32 (the behaviour is reproduced), 1 otherwise.

    python tests/libraries/megatron_cross_entropy_float32.py   # in a venv with megatron-core
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main() -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.cuda.current_device = lambda: torch.device("cpu")
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel()
    logits = torch.tensor([[0.1, 0.2 + 1e-12, 0.3]], dtype=torch.float64)
    target = torch.tensor([1])
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), target)
    dense = F.cross_entropy(logits, target, reduction="none")
    print(
        f"float64 logits: megatron's loss {loss.dtype} {loss.item()!r}, torch's {dense.dtype} {dense.item()!r}, "
        f"difference {abs(loss.double() - dense).item():.3g}"
    )
    dist.destroy_process_group()
    reproduced = loss.dtype == torch.float32
    print("reproduced: the loss of float64 logits is float32" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
