"""torchtitan's sequence-parallel plan with the norm before the SwiGLU left out of SequenceParallel: it normalises each tp rank's sequence shard with a plain, replicated weight, whose gradient is never reduced over tp (each tp rank keeps its own tokens' part; Megatron-LM#1446, gpt-neox#1257).
targets: step_by_step and tp2

The forward is right (RMSNorm is per token); only ``ffn_norm.weight``'s gradient is wrong, and it
differs between the tp ranks. (Leaving the norm out of the plan altogether is an error in torch
2.13, a DTensor input meeting a plain weight; the plan here hands the norm its local shard, as a
hand-written sequence-parallel norm does.)
"""

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from parallelism_conformance.parallelize_examples import good


def parallelize(model, mesh):
    tp = mesh["tp"]
    parallelize_module(
        model,
        tp,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    # the bug: the norm's input and output handed over as local shards, its weight a plain tensor
    local = PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Shard(1),),
        use_local_input=True,
        output_layouts=(Shard(1),),
        desired_output_layouts=(Shard(1),),
    )
    plan = {
        **good.TP_PLAN,
        "attention_norm": SequenceParallel(),
        "attention": gather,
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": local,
        "feed_forward": gather,
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.layers:
        parallelize_module(block, tp, plan)
    return model


parallelize.mesh_dims = ("tp",)
parallelize.divisible_by_tp = ("seq", "vocab")
