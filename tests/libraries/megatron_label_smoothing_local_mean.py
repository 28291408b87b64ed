"""megatron-core's vocab_parallel_cross_entropy (0.16.1) with label smoothing on 2 gloo CPU ranks,
without the suite: the loss and its gradient depend on the tensor-parallel size. In
tensor_parallel/cross_entropy.py, ``vocab_size = exp_logits.size(-1)`` is the rank's own partition
width and ``mean_log_probs = log_probs.mean(dim=-1)`` averages the rank's own columns, with no
reduction over the group (NVIDIA/Megatron-LM#737, #7464; the fixes #5522 and #7466 are unmerged).
So the two ranks' losses differ from each other and from the same call on one rank.

Same logits (6 tokens, a vocabulary of 8), targets and smoothing alpha = 0.1 on both runs: one rank
holding all 8 columns (a 1-rank group), then 2 ranks holding 4 each. The 1-rank loss is checked
against torch's dense F.cross_entropy at Megatron's convention (alpha / (V - 1) on each other class:
torch's eps = alpha V / (V - 1)), so the reference side is Megatron's own, not the suite's.

Prints what it saw and exits 0 when the 2-rank losses differ from the 1-rank loss (the behaviour is
reproduced), 1 otherwise.

    python tests/libraries/megatron_label_smoothing_local_mean.py   # in a venv with megatron-core
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

VOCAB, TOKENS, ALPHA = 8, 6, 0.1


def example():
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(TOKENS, VOCAB, generator=g) + torch.arange(VOCAB) // 4  # the halves' means apart
    return logits, torch.randint(0, VOCAB, (TOKENS,), generator=g)


def megatron_loss(logits, targets, group):
    from megatron.core import parallel_state, tensor_parallel

    parallel_state._TENSOR_MODEL_PARALLEL_GROUP = group  # the call takes no group: it reads this one
    leaf = logits.clone().requires_grad_(True)
    loss = tensor_parallel.vocab_parallel_cross_entropy(leaf, targets, label_smoothing=ALPHA)
    loss.sum().backward()
    return loss.detach(), leaf.grad


def rank_main(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.cuda.current_device = lambda: torch.device("cpu")
    logits, targets = example()
    alone = [dist.new_group([r]) for r in range(2)][rank]  # every rank makes every group
    both = dist.new_group([0, 1])
    results[f"tp1_{rank}"] = megatron_loss(logits, targets, alone)[0].tolist()
    width = VOCAB // 2
    loss, grad = megatron_loss(logits[:, rank * width : (rank + 1) * width].contiguous(), targets, both)
    results[f"tp2_{rank}"] = loss.tolist()
    dist.destroy_process_group()


def main() -> int:
    port = 29500 + os.getpid() % 1000
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(port, results), nprocs=2)
        results = dict(results)
    logits, targets = example()
    dense = F.cross_entropy(logits.double(), targets, reduction="none", label_smoothing=ALPHA * VOCAB / (VOCAB - 1))
    tp1, tp2_0, tp2_1 = (torch.tensor(results[k]) for k in ("tp1_0", "tp2_0", "tp2_1"))
    print(f"alpha={ALPHA}, vocabulary {VOCAB}, {TOKENS} tokens")
    print(f"torch dense (Megatron's convention): {dense.float().tolist()}")
    print(f"megatron TP=1:                       {tp1.tolist()}")
    print(f"megatron TP=2, rank 0:               {tp2_0.tolist()}")
    print(f"megatron TP=2, rank 1:               {tp2_1.tolist()}")
    print(
        f"TP=1 against dense: {(tp1.double() - dense).abs().max().item():.3g}; TP=2 against TP=1: rank 0 "
        f"{(tp2_0 - tp1).abs().max().item():.3g}, rank 1 {(tp2_1 - tp1).abs().max().item():.3g}"
    )
    agrees_alone = torch.allclose(tp1.double(), dense, atol=1e-5)
    reproduced = agrees_alone and not (torch.allclose(tp2_0, tp1, atol=1e-5) and torch.allclose(tp2_1, tp1, atol=1e-5))
    print("reproduced: the 2-rank loss differs from the 1-rank loss" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
