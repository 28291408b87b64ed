"""FSDP2 applied before the tensor-parallel plan (torchtitan applies TP first): fully_shard has already sharded each block's weights over dp_shard when parallelize_module would shard them over tp, from the FSDP shard, not the whole weight TP needs.
targets: step_by_step and dp_shard2-tp2

torch 2.13 refuses it on the ranks (a ValueError: "Cannot distribute a DTensor with device mesh
(dp_shard=2) to a different device mesh (tp=2)"): one failed test with the ranks' traceback, naming
the mesh. On CPU ranks the wrong values an FSDP unit that reshards what TP still needs would give
cannot be reached through torch's own APIs (FSDP2 all-gathers a unit's parameters again before its
backward).
"""

from parallelism_conformance.parallelize_examples import good


def parallelize(model, mesh):
    model = good.fsdp(model, mesh)
    return good.tensor_parallel(model, mesh)


parallelize.mesh_dims = ("dp_shard", "tp")
