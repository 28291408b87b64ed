"""torchtitan's FSDP2 sums gradients over ranks, and on gloo its reduce-scatter needs torch's
force-sum option (the one shim of adapters/torchtitan.py). Standalone: 2 gloo CPU ranks, no suite.

``apply_fsdp_to_decoder`` (distributed/fsdp.py) is called as ``parallelize_llama`` calls it, on a
stand-in decoder with the attributes it reads (tok_embeddings, layers, norm, lm_head; torchtitan's own
models do not import beside a CPU torch, tests/libraries/torchtitan_imports_triton.py). It ends with
``disable_fsdp_gradient_division``: gradient_divide_factor 1.0 on every FSDP module, which torch's
FSDP2 reduce-scatters as ``ReduceOp.PREMUL_SUM(1.0)``. Each rank computes the loss of its own sample:

1. as applied, backward fails on gloo ("Cannot use ReduceOp.PREMUL_SUM with Gloo");
2. with ``set_force_sum_reduction_for_comms(True)`` on every FSDP module (torchtitan's own call in
   ``enable_fsdp_symm_mem``), each rank's gradient shard is the SUM of the ranks' gradients (one
   process's on both samples, summed), not their mean.

Prints what each rank saw and exits 0 when both hold (reproduced), 1 otherwise.

    python tests/libraries/torchtitan_fsdp_sums_on_gloo.py   # in a venv with torchtitan==0.3.0
"""

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class Decoder(nn.Module):
    """What apply_fsdp_to_decoder reads of torchtitan's Decoder, and a forward through it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.enable_weight_tying = False
        self.tok_embeddings = nn.Embedding(8, 4)
        self.layers = nn.ModuleDict({"0": nn.Linear(4, 4), "1": nn.Linear(4, 4)})
        self.norm = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 8, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = h + torch.tanh(layer(h))
        return self.lm_head(self.norm(h))


def loss_of(model, tokens):
    return nn.functional.cross_entropy(model(tokens[:-1]), tokens[1:], reduction="sum")


def rank_main(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    samples = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7, 0, 1, 3])]
    dense = Decoder()
    summed = {}
    for tokens in samples:  # one process, each sample's gradient, summed
        dense.zero_grad()
        loss_of(dense, tokens).backward()
        for name, p in dense.named_parameters():
            summed[name] = summed.get(name, 0) + p.grad.clone()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    outcomes = []
    for force_sum in (False, True):
        model = copy.deepcopy(Decoder())
        apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
        if force_sum:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
        try:
            loss_of(model, samples[rank]).backward()
        except Exception as error:  # noqa: BLE001 - what gloo says is the finding
            outcomes.append(f"error: {str(error).splitlines()[0][:120]}")
            continue
        ok = all(torch.allclose(p.grad.full_tensor(), summed[name], rtol=1e-5, atol=1e-6) for name, p in model.named_parameters())
        outcomes.append(f"gradients equal the sum over ranks: {ok}")
    results[rank] = outcomes
    dist.destroy_process_group()


def main() -> int:
    port = 29500 + os.getpid() % 1000
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(port, results), nprocs=2)
        for rank in (0, 1):
            print(f"rank {rank}: as applied: {results[rank][0]}; with force-sum: {results[rank][1]}")
        reproduced = all("PREMUL_SUM" in results[r][0] and results[r][1] == "gradients equal the sum over ranks: True" for r in (0, 1))
    print("reproduced: torchtitan's FSDP2 sums gradients, and needs force-sum on gloo" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
