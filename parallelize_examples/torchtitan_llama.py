"""torchtitan's own ``parallelize_llama`` (torchtitan 0.3.0, models/llama3/parallelize.py) on its own
Llama, in the suite's second form (``form = "torchtitan"``): ``parallelize_llama(model,
parallel_dims, job_config)``. Run it in torchtitan's venv (``scripts/libraries --prepare
torchtitan`` makes .venv-libraries/torchtitan-0.3.0):

    .venv-libraries/torchtitan-0.3.0/bin/python -m pytest conformance/test_parallelize.py \\
        --parallelize parallelize_examples/torchtitan_llama.py:parallelize_llama

torchtitan 0.3.0 takes the job config's sections as keywords; this unpacks them exactly as its
trainer does (trainer.py: ``model_spec.parallelize_fn(model, parallel_dims=..., training=
config.training, parallelism=config.parallelism, compile_config=config.compile, ac_config=
config.activation_checkpoint, dump_folder=config.dump_folder)``). torchtitan is imported when it
runs, so this module imports anywhere (it ships in the wheel).

What it sets, as a user on CPU ranks would (the suite's job_config, harness/rank/torchtitan_form.py,
has the rest): compile off, no activation checkpointing, spmd_backend "partial_dtensor", float32.
One shim of its own, after torchtitan's function returns: on gloo,
``set_force_sum_reduction_for_comms(True)`` on every FSDP module. parallelize_llama ends in
``apply_fsdp_to_decoder``, whose ``disable_fsdp_gradient_division`` sets divide factor 1.0, and FSDP2
then reduce-scatters with ``ReduceOp.PREMUL_SUM``, which gloo lacks; torchtitan sets the same option
itself where ``parallelism.enable_fsdp_symm_mem`` is on, but that also asks for symmetric memory,
CUDA only (tests/libraries/torchtitan_fsdp_sums_on_gloo.py shows the gloo failure without it).

The loss is torchtitan's in this form (the suite's harness computes it as torchtitan's train_step
does: each rank's summed cross entropy over the global batch's valid-token count), so the gradients
summed over the data-parallel ranks, as ``disable_fsdp_gradient_division`` leaves them, are the
global token mean's."""

from __future__ import annotations


def parallelize_llama(model, parallel_dims, job_config):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.models.llama3 import parallelize_llama as torchtitan_parallelize_llama

    model = torchtitan_parallelize_llama(
        model,
        parallel_dims=parallel_dims,
        training=job_config.training,
        parallelism=job_config.parallelism,
        compile_config=job_config.compile,
        ac_config=job_config.activation_checkpoint,
        dump_folder=job_config.dump_folder,
    )
    if dist.get_backend() == "gloo":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (the module docstring)
    return model


parallelize_llama.form = "torchtitan"
parallelize_llama.model = "torchtitan_llama3"
parallelize_llama.mesh_dims = ("dp_replicate", "dp_shard", "tp")
# torchtitan's sequence parallel shards the sequence over tp, its lm_head the vocabulary
parallelize_llama.divisible_by_tp = ("seq", "vocab")
