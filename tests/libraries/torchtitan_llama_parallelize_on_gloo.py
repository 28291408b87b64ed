"""torchtitan's own Llama (``Llama3Model``, a tiny config built as its flavors are, by
``_build_llama3_layers``), parallelized by ``parallelize_llama`` (models/llama3/parallelize.py:
tensor parallelism by ``model.parallelize(parallel_dims)``, then FSDP2 by ``apply_fsdp_to_decoder``)
on 4 gloo ranks, data-parallel shard 2 x tensor-parallel 2, against the same model in one process.
What it takes on a CPU, each printed as seen:

* ``torchtitan.tools.utils.device_type`` is ``_get_available_device_type() or "cuda"``: "cuda" on a
  machine without an accelerator, and ``ParallelDims.build_mesh`` builds its meshes on it; set to
  "cpu" here (torchtitan only asks which device).
* FlexAttention, the default of ``get_attention_config``, has no backward on CPU: the blocks' inner
  attention is torchtitan's ``ScaledDotProductAttention`` (causal), which 0.3.0's
  ``get_attention_config("sdpa")`` no longer hands to language models.
* ``spmd_backend`` "spmd_types", the default, makes ``apply_fsdp_to_decoder`` ask for parameters that
  are DTensors on the whole mesh, which ``model.parallelize`` does not give under it here;
  "partial_dtensor" (DTensor for the model-parallel axes only) runs.
* gloo has no PREMUL_SUM: ``set_force_sum_reduction_for_comms(True)`` on every FSDP module
  (torchtitan_fsdp_sums_on_gloo.py).

The loss is torchtitan's: the sum of the per-token cross entropy over this rank's samples divided by
the global token count, its gradients summed over the data-parallel ranks (divide factor 1). Exits 0
when the three obstacles are seen and every gradient, gathered, equals the dense model's within
1e-5 (1 + |dense|) in float32 (reproduced), 1 otherwise.

    python tests/libraries/torchtitan_llama_parallelize_on_gloo.py   # torchtitan 0.3.0, triton, CPU torch
"""

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, TP, BATCH, SEQ, VOCAB, DIM, HEADS = 4, 2, 4, 8, 32, 16, 4


def config(inner_sdpa: bool):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers, _output_linear_init
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    layers = _build_llama3_layers(
        fuse_qkv=True,
        n_layers=2,
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=2,
        hidden_dim=32,
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=10000.0),
        attn_backend="flex",
    )
    if inner_sdpa:
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers,
    )
    set_llama3_sharding_config(cfg, enable_sp=True)  # what Llama3Model.Config.update_from_config does
    return cfg


def build(inner_sdpa: bool = True):
    torch.manual_seed(0)
    model = config(inner_sdpa).build()
    model.init_weights()
    return model


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_of(logits, targets):  # torchtitan's: summed over tokens, divided by the global count
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") / (BATCH * SEQ)


def flex_has_no_cpu_backward() -> bool:
    model = build(inner_sdpa=False)
    tokens, targets = data()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    try:
        loss_of(model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions)), targets).backward()
    except NotImplementedError as error:
        print(f"FlexAttention backward on CPU: {error}")
        return True
    return False


def rank_main(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.tools.utils as utils
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    seen = {"device_type": utils.device_type}
    utils.device_type = parallel_dims_module.device_type = "cpu"  # the shim: torchtitan asks which device
    training = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32")
    for backend in ("spmd_types", "partial_dtensor"):
        parallelism = ParallelismConfig(data_parallel_shard_degree=WORLD // TP, tensor_parallel_degree=TP, spmd_backend=backend)
        dims = ParallelDims.from_config(parallelism, WORLD)
        dims.build_mesh()
        model = build()
        try:
            parallelize_llama(
                model,
                parallel_dims=dims,
                training=training,
                parallelism=parallelism,
                compile_config=CompileConfig(),
                ac_config=None,
                dump_folder=".",
            )
        except ValueError as error:
            seen[backend] = f"{type(error).__name__}: {error}"
            continue
        seen[backend] = "parallelized"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    tokens, targets = data()
    replica = dims.get_mesh("fsdp").get_local_rank()
    mine = slice(replica * BATCH // (WORLD // TP), (replica + 1) * BATCH // (WORLD // TP))
    logits = model(tokens[mine])
    loss_of(logits.full_tensor() if hasattr(logits, "full_tensor") else logits, targets[mine]).backward()
    dense = build()
    loss_of(dense(tokens), targets).backward()
    expected = dict(dense.named_parameters())
    worst = 0.0
    for name, parameter in model.named_parameters():
        grad = parameter.grad.full_tensor() if hasattr(parameter.grad, "full_tensor") else parameter.grad
        worst = max(worst, ((grad - expected[name].grad).abs() / (1 + expected[name].grad.abs())).max().item())
    seen["worst"] = worst
    results[rank] = seen
    dist.destroy_process_group()


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flex = flex_has_no_cpu_backward()
    results = mp.Manager().dict()
    mp.spawn(rank_main, args=(port, results), nprocs=WORLD)
    seen = results[0]
    print(f"torchtitan.tools.utils.device_type on this machine: {seen['device_type']!r}")
    print(f"parallelize_llama with spmd_backend='spmd_types': {seen['spmd_types'][:200]}")
    print(f"parallelize_llama with spmd_backend='partial_dtensor': {seen['partial_dtensor']}")
    worst = max(r["worst"] for r in results.values())
    print(f"dp_shard {WORLD // TP} x tp {TP}: worst gradient difference against the dense model, relative to 1 + |dense|: {worst:.3g}")
    reproduced = (
        flex
        and seen["device_type"] == "cuda"
        and seen["spmd_types"].startswith("ValueError")
        and seen["partial_dtensor"] == "parallelized"
        and worst <= 1e-5
    )
    print("reproduced: parallelize_llama trains torchtitan's Llama on gloo with these shims" if reproduced else "not reproduced")
    return 0 if reproduced else 1


if __name__ == "__main__":
    sys.exit(main())
