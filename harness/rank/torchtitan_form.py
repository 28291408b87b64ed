"""The second form of a parallelize function, torchtitan's: ``function(model, parallel_dims,
job_config) -> model`` (``function.form = "torchtitan"``; CONTRACT.md, "A parallelize function").
What the ranks hand it, built here per mesh:

* ``parallel_dims``: torchtitan's own ``ParallelDims`` (distributed/parallel_dims.py), from a
  ``ParallelismConfig`` of the mesh's degrees (cp, pp and ep 1), its meshes built
  (``build_mesh``) once per world, as RankContext.device_mesh makes the named mesh: each build
  makes a process group per dimension and slice. ``spmd_backend`` "partial_dtensor" (DTensor
  for the model-parallel axes only): the default, "spmd_types", makes ``apply_fsdp_to_decoder`` ask
  for parameters that are DTensors on the whole mesh, which ``model.parallelize`` does not give on
  these ranks (tests/libraries/torchtitan_llama_parallelize_on_gloo.py shows the ValueError).
  One stand-in, torchtitan's only question of the machine: ``torchtitan.tools.utils.device_type``
  is ``_get_available_device_type() or "cuda"``, "cuda" on a CPU-only machine, and ``build_mesh``
  builds on it; it is set to the rank's device type before the build.
* ``job_config``: the sections of torchtitan's trainer ``Config`` its ``parallelize_fn`` reads
  (trainer.py passes ``training=config.training, parallelism=config.parallelism,
  compile_config=config.compile, ac_config=config.activation_checkpoint,
  dump_folder=config.dump_folder``), as torchtitan's own dataclasses: ``training``
  (``mixed_precision_param`` and ``mixed_precision_reduce`` "float32": the model's own dtype, so
  FSDP2 casts nothing; ``seq_len`` and ``local_batch_size`` the example's), ``parallelism`` (the one
  above), ``compile`` (``enable`` False: compile is not judged, docs/parallelize.md),
  ``activation_checkpoint`` None (parallelize_llama applies none then), ``dump_folder`` a
  temporary directory. A function written for torchtitan 0.3.0's keyword form unpacks it as
  trainer.py does (parallelize_examples/torchtitan_llama.py).

Where torchtitan does not import, both are harness/rank/parallel_dims_stand_in.py's (the same names
and values, the suite's decoder only: torchtitan's Llama needs torchtitan)."""

from __future__ import annotations

import importlib.util
import tempfile
from types import SimpleNamespace

from parallelism_conformance.harness.rank import parallel_dims_stand_in

FORM = "torchtitan"
FORMS = ("mesh", FORM)


def parallel_dims(ctx, mesh: list):
    """torchtitan's ParallelDims of ``mesh`` ([[dim name, size], ...] over dp_replicate, dp_shard,
    tp), its meshes built once per world (kept with the world's DeviceMeshes on the RankContext);
    collective (every rank asks the same, as with init_device_mesh)."""
    if importlib.util.find_spec("torchtitan") is None:
        return parallel_dims_stand_in.parallel_dims(ctx, mesh)
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    import torchtitan.tools.utils as utils
    from torchtitan.distributed import ParallelDims

    key = (FORM, tuple((str(name), int(size)) for name, size in mesh))
    if key not in ctx._meshes:
        utils.device_type = parallel_dims_module.device_type = ctx.device.type  # the stand-in (module docstring)
        dims = ParallelDims.from_config(parallelism(dict(key[1])), ctx.world_size)
        dims.build_mesh()
        ctx._meshes[key] = dims
    return ctx._meshes[key]


def parallelism(sizes: dict):
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(
        data_parallel_replicate_degree=sizes.get("dp_replicate", 1),
        data_parallel_shard_degree=sizes.get("dp_shard", 1),
        tensor_parallel_degree=sizes.get("tp", 1),
        spmd_backend="partial_dtensor",
    )


def job_config(mesh: list, seq: int, rows: int) -> SimpleNamespace:
    """The sections of torchtitan's trainer Config a parallelize_fn reads (the module docstring)."""
    if importlib.util.find_spec("torchtitan") is None:
        return parallel_dims_stand_in.job_config(mesh, seq, rows)
    from torchtitan.config import CompileConfig, TrainingConfig

    training = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32", seq_len=seq, local_batch_size=rows)
    return SimpleNamespace(
        training=training,
        parallelism=parallelism({str(name): int(size) for name, size in mesh}),
        compile=CompileConfig(enable=False),
        activation_checkpoint=None,
        dump_folder=tempfile.gettempdir(),
    )
