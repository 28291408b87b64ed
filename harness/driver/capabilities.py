"""The capability registry: one declaration per capability, the one place that says what it is
called, what an implementation provides for it, which conformance file grades it and which folder
of mutants it must kill. Driver side only (ranks never import it).

Driven by it: ``--capability`` (what an implementation claims), the mutation runner's mapping from
a mutants folder to its conformance file, and the audit's "this audits X" skip when X is not
claimed. Checked against it by tests/test_registry.py: the rubric's keys, every ``capability``
marker in conformance/, the mutants folders, the starter's names and the bundled implementation's
names, every file a declaration names (its reference, implementation, rank program, audit, adapter,
outsiders and CONTRACT.md section). Adding a capability is one declaration here plus those files.
"""

from __future__ import annotations

from dataclasses import dataclass

COLLECTIVES = (
    "broadcast",
    "reduce",
    "all_reduce",
    "scatter",
    "gather",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
)


@dataclass(frozen=True)
class Capability:
    name: str  # the scorecard row, the rubric key, the value of the tests' capability marker
    provides: tuple[str, ...]  # the names an implementation offers for it (CONTRACT.md says what they do)
    conformance: str  # the test file that grades it
    mutants: str | None  # the folder under mutants/ whose implementations it must fail
    group: str = ""  # a name that selects several at once with --capability (e.g. "collectives")
    contract: str = ""  # the heading of its section in CONTRACT.md
    # every other file or folder of it: its reference (the oracle), the bundled implementation, the
    # rank program, its audit test and cost model, torch's adapter, the outsiders' folder
    files: tuple[str, ...] = ()


_PROGRAM_HELPERS = {"pipeline_parallel": ("pipeline_stages",)}  # the modules of harness/rank/programs a program's module imports


def _files(
    reference: tuple[str, ...],
    impl: str | None,
    program: str,
    audit: str | None = None,
    adapter: str | None = None,
    outsiders: str | None = None,
) -> tuple[str, ...]:
    named = [
        *(f"reference/{r}.py" for r in reference),
        impl and f"impls/{impl}.py",
        f"harness/rank/programs/{program}.py",
        *(f"harness/rank/programs/{helper}.py" for helper in _PROGRAM_HELPERS.get(program, ())),
        audit and f"conformance/audit/test_{audit}.py",
        audit and "reference/cost_model.py",
        adapter and f"adapters/{adapter}.py",
        outsiders and f"outsiders/{outsiders}",
    ]
    return tuple(name for name in named if name)


_COLLECTIVE_FILES = (
    *_files(("collectives", "tolerance"), "collectives", "collectives", "collectives", outsiders="collectives"),
    "impls/collective_args.py",
    "impls/ring_and_tree.py",
)
_DP = ("data_parallel",)
_PP = (
    "pipeline_parallel",
    "pipeline_schedules",
    "schedule_format",
    "schedule_generators",
    "schedule_theory",
    "schedule_validator",
    "pipeline_simulator",
)


# a table, one declaration a capability with its fields aligned to be read across: the formatter leaves it as written
# fmt: off
CAPABILITIES: tuple[Capability, ...] = (
    *(Capability(name, (name,), "conformance/test_collectives.py", "collectives", "collectives", "Collectives",
                 _COLLECTIVE_FILES) for name in COLLECTIVES),
    Capability("equivalences", COLLECTIVES, "conformance/test_collectives.py", "collectives", "collectives",
               "Collectives", _COLLECTIVE_FILES),
    Capability("data_parallel", ("DataParallel",), "conformance/test_data_parallel.py", "data_parallel",
               contract="Data parallelism", files=(*_files(_DP, "data_parallel", "data_parallel", "data_parallel",
                                                           "torch_ddp", "data_parallel"),
                                                   "impls/naive_dp.py", "adapters/cs336.py",
                                                   "adapters/cs336_metadata.py", "adapters/deepspeed.py",
                                                   "adapters/megatron_core_ddp.py")),
    Capability("sharded_optimizer", ("ShardedOptimizer",), "conformance/test_sharded_optimizer.py", "sharded_optimizer",
               contract="Sharded optimizer", files=(*_files(_DP, "sharded_optimizer", "sharded_optimizer",
                                                            "sharded_optimizer", "torch_zero", "sharded_optimizer"),
                                                    "adapters/cs336.py", "adapters/deepspeed.py", "adapters/deepspeed_zero2.py",
                                                    "adapters/deepspeed_offload.py", "adapters/deepspeed_zero2_offload.py",
                                                    "adapters/fairscale.py", "adapters/fairscale_oss.py",
                                                    "adapters/nanotron.py")),
    Capability("fully_sharded", ("fully_shard", "full_parameters"), "conformance/test_fully_sharded.py",
               "fully_sharded", contract="Fully sharded data parallelism",
               files=(*_files(_DP, "fully_sharded", "fully_sharded", "fully_sharded", "torch_fsdp", "fully_sharded"),
                      "adapters/cs336.py", "adapters/cs336_layers.py", "adapters/deepspeed.py",
                      "adapters/deepspeed_offload.py", "adapters/fairscale.py", "adapters/fairscale_cpu.py")),
    Capability("zero2", ("fully_shard", "full_parameters"), "conformance/test_fully_sharded.py", None,
               contract="Fully sharded data parallelism",
               files=_files(_DP, "fully_sharded", "fully_sharded", "fully_sharded", "torch_fsdp")),
    Capability("fsdp_compute_dtype", ("fully_shard", "full_parameters"), "conformance/test_fully_sharded.py", None,
               contract="Fully sharded data parallelism",
               files=(*_files(("mixed_precision", "tolerance"), "fully_sharded", "fully_sharded", "fully_sharded",
                              "torch_fsdp"), "adapters/cs336.py", "conformance/compute_dtype.py")),
    Capability("checkpoint_reshard", ("save_checkpoint", "load_checkpoint", "fully_shard", "full_parameters",
                                      "ShardedOptimizer"),
               "conformance/test_checkpoint_reshard.py", "checkpoint_reshard", contract="Checkpoints that reshard",
               files=(*_files(_DP, "checkpointing", "checkpointing", adapter="torch_checkpoint",
                             outsiders="checkpoint_reshard"),
                      "harness/rank/programs/fully_sharded.py")),
    Capability("checkpoint_tp", ("save_checkpoint", "load_checkpoint", "TensorParallelMLP", "fully_shard",
                                 "full_parameters", "ShardedOptimizer"),
               "conformance/test_checkpoint_reshard.py", None, contract="Checkpoints that reshard",
               files=(*_files(_DP, "checkpointing", "checkpointing", adapter="torch_checkpoint"),
                      "impls/tensor_parallel.py", "adapters/dtensor_tp.py")),
    Capability("checkpoint_rng", ("save_checkpoint", "load_checkpoint", "fully_shard", "full_parameters",
                                  "ShardedOptimizer"),
               "conformance/test_checkpoint_reshard.py", None, contract="Checkpoints that reshard",
               files=_files(_DP, "checkpointing", "checkpointing", adapter="torch_checkpoint")),
    Capability("fsdp_dropout", ("fully_shard", "full_parameters"), "conformance/test_random_streams.py",
               "fsdp_dropout", contract="Fully sharded data parallelism",
               files=_files(("data_parallel", "random_streams"), "fully_sharded", "fully_sharded",
                            adapter="torch_fsdp")),
    Capability("fsdp_init", ("fully_shard", "full_parameters", "init_sharded"), "conformance/test_sharded_init.py",
               "fsdp_init", contract="Fully sharded data parallelism",
               files=(*_files(("data_parallel", "initialisation"), "fully_sharded", "fully_sharded",
                              adapter="torch_fsdp", outsiders="fsdp_init"), "impls/sharded_init.py")),
    Capability("checkpoint_pp", ("save_checkpoint", "load_checkpoint", "pipeline_step", "all_reduce", "fully_shard",
                                 "full_parameters", "ShardedOptimizer"),
               "conformance/test_checkpoint_reshard.py", None, contract="Checkpoints that reshard",
               files=(*_files(_DP, "checkpointing", "checkpointing", adapter="torch_checkpoint",
                              outsiders="checkpoint_pp"),
                      "impls/pipeline_parallel.py", "adapters/torch_pipelining.py")),
    Capability("dp_compute_dtype", ("DataParallel",), "conformance/test_data_parallel.py", "dp_compute_dtype",
               contract="Data parallelism",
               files=(*_files(("mixed_precision", "tolerance"), "data_parallel", "data_parallel", adapter="torch_ddp",
                              outsiders="dp_compute_dtype"), "conformance/compute_dtype.py", "adapters/deepspeed_precision.py")),
    Capability("grad_clipping", ("clip_grad_norm_",), "conformance/test_grad_clipping.py", "grad_clipping",
               contract="Gradient clipping by the global norm",
               files=(*_files((*_DP, "tensor_parallel"), "grad_clipping", "fully_sharded", "grad_clipping",
                             "torch_grad_clipping"),
                      "harness/rank/programs/data_parallel.py", "harness/rank/programs/tensor_parallel.py")),
    Capability("token_loss", ("global_token_count", "DataParallel", "fully_shard", "full_parameters"),
               "conformance/test_token_loss.py", "token_loss", contract="Loss normalised by the global token count",
               files=(*_files(("token_loss", "data_parallel"), "token_loss", "data_parallel", adapter="torch_token_loss",
                              outsiders="token_loss"),
                      "harness/rank/token_loss.py", "harness/rank/programs/fully_sharded.py",
                      "adapters/torch_ddp.py", "adapters/torch_fsdp.py", "adapters/torchtitan.py",
                      "adapters/torchtitan_refusals.py")),
    Capability("data_sampler", ("DistributedSampler",), "conformance/test_data_sampler.py", "data_sampler",
               contract="Distributed sampling",
               files=_files(("data_sampling",), "data_sampling", "data_sampler", adapter="torch_sampler",
                            outsiders="data_sampler")),
    Capability("sampler_resume", ("DistributedSampler",), "conformance/test_sampler_resume.py", "sampler_resume",
               contract="Distributed sampling",
               files=_files(("data_sampling",), "data_sampling", "data_sampler", adapter="torch_sampler")),
    Capability("tensor_parallel", ("ColumnParallelLinear", "RowParallelLinear", "TensorParallelMLP"),
               "conformance/test_tensor_parallel.py", "tensor_parallel", contract="Tensor parallelism",
               files=(*_files(("tensor_parallel",), "tensor_parallel", "tensor_parallel", "tensor_parallel",
                              "dtensor_tp", "tensor_parallel"),
                      "adapters/megatron_core.py", "adapters/megatron_core_refusals.py", "adapters/nanotron.py")),
    Capability("tp_norm", ("TensorParallelMLP",), "conformance/test_tensor_parallel.py", "tp_norm",
               contract="Tensor parallelism",
               files=_files(("tensor_parallel",), "tensor_parallel", "tensor_parallel", adapter="dtensor_tp",
                            outsiders="tp_norm")),
    Capability("tp_dropout", ("TensorParallelMLP",), "conformance/test_tp_dropout.py", "tp_dropout",
               contract="Tensor parallelism",
               files=_files(("tensor_parallel",), "tensor_parallel", "tensor_parallel", adapter="dtensor_tp",
                            outsiders="tp_dropout")),
    Capability("tp_compute_dtype", ("TensorParallelMLP",), "conformance/test_tp_compute_dtype.py",
               "tp_compute_dtype", contract="Tensor parallelism",
               files=_files(("tensor_parallel",), "tensor_parallel", "tensor_parallel", adapter="dtensor_tp",
                            outsiders="tp_compute_dtype")),
    Capability("tp_attention", ("TensorParallelAttention",), "conformance/test_tp_attention.py", "tp_attention",
               contract="Attention and SwiGLU",
               files=(*_files(("transformer_layers", "tensor_parallel"), "transformer_layers", "transformer_layers",
                              adapter="dtensor_block", outsiders="tp_attention"), "conformance/tp_refusals.py")),
    Capability("tp_swiglu", ("TensorParallelSwiGLU",), "conformance/test_tp_swiglu.py", "tp_swiglu",
               contract="Attention and SwiGLU",
               files=(*_files(("transformer_layers", "tensor_parallel"), "transformer_layers", "transformer_layers",
                              adapter="dtensor_block", outsiders="tp_swiglu"), "conformance/tp_refusals.py")),
    Capability("vocab_parallel", ("VocabParallelEmbedding", "vocab_parallel_cross_entropy"), "conformance/test_vocab_parallel.py",
               "vocab_parallel", contract="Vocabulary-parallel cross entropy",
               files=_files(("vocab_parallel",), "vocab_parallel", "tensor_parallel", adapter="torch_vocab_parallel",
                            outsiders="vocab_parallel")),
    Capability("vocab_label_smoothing", ("vocab_parallel_cross_entropy",), "conformance/test_vocab_parallel.py",
               "vocab_label_smoothing", contract="Vocabulary-parallel cross entropy",
               files=_files(("vocab_parallel",), "vocab_parallel", "tensor_parallel", adapter="torch_vocab_parallel")),
    Capability("composition", ("TensorParallelMLP", "all_reduce"), "conformance/test_composition.py", "composition",
               contract="Composition on a device mesh",
               files=_files(("mesh", "topology", "tensor_parallel"), None, "composition", "composition", "torch_native",
                            "composition")),
    Capability("expert_parallel", ("ExpertParallelMoE",), "conformance/test_expert_parallel.py", "expert_parallel",
               contract="Expert parallelism",
               files=_files(("expert_parallel",), "expert_parallel", "expert_parallel", "expert_parallel", "torch_moe",
                            "expert_parallel")),
    Capability("moe_mesh", ("ExpertParallelMoE", "all_reduce"), "conformance/test_moe_mesh.py", "moe_mesh",
               contract="Expert parallelism inside data parallelism",
               files=_files(("expert_parallel",), "expert_parallel", "expert_parallel", adapter="torch_moe")),
    Capability("moe_tp_mesh", ("ExpertParallelMoE", "all_reduce"), "conformance/test_moe_mesh.py", "moe_tp_mesh",
               contract="Expert parallelism inside data parallelism",
               files=_files(("expert_parallel",), "expert_parallel", "expert_parallel", adapter="torch_moe")),
    Capability("moe_clipping", ("ExpertParallelMoE", "clip_grad_norm_", "all_reduce"), "conformance/test_moe_clipping.py",
               "moe_clipping", contract="Gradient clipping by the global norm",
               files=(*_files(("expert_parallel", "data_parallel"), "grad_clipping", "expert_parallel",
                              adapter="torch_grad_clipping"), "impls/expert_parallel.py", "adapters/torch_moe.py")),
    Capability("moe_topk", ("ExpertParallelMoE",), "conformance/test_moe_topk.py", "moe_topk",
               contract="Mixture of experts as trained",
               files=_files(("moe_routing", "expert_parallel"), "expert_parallel", "expert_parallel", adapter="torch_moe",
                            outsiders="moe_topk")),
    Capability("moe_capacity", ("ExpertParallelMoE",), "conformance/test_moe_topk.py", "moe_capacity",
               contract="Mixture of experts as trained",
               files=_files(("moe_routing", "expert_parallel"), "expert_parallel", "expert_parallel", adapter="torch_moe",
                            outsiders="moe_capacity")),
    Capability("moe_sequence_parallel", ("ExpertParallelMoE",), "conformance/test_moe_topk.py", "moe_sequence_parallel",
               contract="Mixture of experts as trained",
               files=_files(("moe_routing", "expert_parallel"), "expert_parallel", "expert_parallel", adapter="torch_moe")),
    Capability("context_parallel", ("context_parallel_attention",), "conformance/test_context_parallel.py",
               "context_parallel", contract="Context parallelism",
               files=_files(("context_parallel",), "context_parallel", "context_parallel", "context_parallel",
                            "torch_context_parallel", "context_parallel")),
    Capability("pipeline_parallel", ("pipeline_step",), "conformance/test_pipeline_parallel.py", "pipeline_parallel",
               contract="`pipeline_step`",
               files=_files(_PP, "pipeline_parallel", "pipeline_parallel", None, "torch_pipelining",
                            "pipeline_parallel")),
    Capability("pipeline_schedules", ("generate_schedule",), "conformance/test_pipeline_parallel.py", None,
               contract="`generate_schedule`",
               files=_files(_PP, "pipeline_parallel", "pipeline_parallel", None, "torch_pipelining",
                            "pipeline_schedules")),
    Capability("pipeline_dropout", ("pipeline_step",), "conformance/test_pipeline_dropout.py", "pipeline_dropout",
               contract="`pipeline_step` (capability `pipeline_parallel`)",
               files=_files(("pipeline_parallel",), "pipeline_parallel", "pipeline_parallel",
                            adapter="torch_pipelining")),
    Capability("pipeline_tied", ("pipeline_step", "sync_tied_gradients", "clip_grad_norm_"), "conformance/test_tied_weights.py",
               "pipeline_tied", contract="A weight tied across stages",
               files=(*_files(_PP, "tied_weights", "pipeline_parallel", adapter="torch_tied_weights",
                              outsiders="pipeline_tied"),
                      "adapters/torch_pipelining.py")),
    Capability("zero_bubble", ("pipeline_step", "generate_schedule"), "conformance/test_zero_bubble.py", "zero_bubble",
               contract="Zero-bubble schedules",
               files=_files(_PP, "pipeline_parallel", "pipeline_parallel", None, "torch_pipelining", "zero_bubble")),
    Capability("zero_bubble_v", ("pipeline_step", "generate_schedule"), "conformance/test_zero_bubble_v.py",
               "zero_bubble_v", contract="The V: ZB-V",
               files=_files(_PP, "pipeline_parallel", "pipeline_parallel", "zero_bubble_v", "torch_pipelining",
                            "zero_bubble_v")),
    Capability("pipeline_token_loss", ("pipeline_step",), "conformance/test_pipeline_parallel.py", "pipeline_token_loss",
               contract="`pipeline_step`",
               files=(*_files(_PP, "pipeline_parallel", "pipeline_parallel", None, "torch_pipelining"),
                      "adapters/torchtitan_pipeline.py")),
    Capability("stage_split", ("split_stages",), "conformance/test_stage_split.py", "stage_split",
               contract="Splitting a model into stages",
               files=_files(("pipeline_parallel",), "pipeline_parallel", "pipeline_parallel", adapter="torch_pipelining",
                            outsiders="stage_split")),
    Capability("pipeline_composition", ("pipeline_step", "all_reduce"), "conformance/test_pipeline_composition.py",
               "pipeline_composition", contract="Data parallelism over pipelines",
               files=_files(("mesh", "pipeline_parallel"), None, "pipeline_parallel", None, "torch_native",
                            "pipeline_composition")),
    Capability("dp_pp_token_loss", ("pipeline_step", "global_token_count", "all_reduce"),
               "conformance/test_dp_pp_token_loss.py", "dp_pp_token_loss", contract="Data parallelism over pipelines",
               files=_files(("mesh", "pipeline_parallel", "token_loss"), None, "pipeline_parallel", None,
                            "torch_native")),
    Capability("mesh_transformer", ("TensorParallelAttention", "TensorParallelSwiGLU", "VocabParallelEmbedding",
                                    "vocab_parallel_cross_entropy", "pipeline_step", "sync_tied_gradients",
                                    "all_reduce"),
               "conformance/test_mesh_transformer.py", "mesh_transformer",
               contract="The whole block on one mesh",
               files=(*_files(("mesh", "transformer_model", "transformer_layers", "vocab_parallel"), None,
                              "mesh_transformer", adapter="torch_native"), "harness/rank/pipeline_models.py")),
    Capability("mesh_clipping", ("TensorParallelMLP", "pipeline_step", "all_reduce", "clip_grad_norm_"),
               "conformance/test_mesh_composition.py", "mesh_clipping", contract="Data, tensor and pipeline parallelism on one mesh",
               files=(*_files(("mesh", "pipeline_parallel", "data_parallel"), "grad_clipping", "pipeline_parallel",
                              adapter="torch_grad_clipping"),)),
    Capability("mesh_composition", ("TensorParallelMLP", "pipeline_step", "all_reduce"),
               "conformance/test_mesh_composition.py", "mesh_composition",
               contract="Data, tensor and pipeline parallelism on one mesh",
               files=_files(("mesh", "topology", "pipeline_parallel", "tensor_parallel"), None, "pipeline_parallel",
                            "mesh_composition", "torch_native", "mesh_composition")),
    # a team's own function over a named DeviceMesh (--parallelize): it provides no contract names
    Capability("parallelize", (), "conformance/test_parallelize.py", "parallelize", contract="A parallelize function",
               files=(*_files(("parallelize",), None, "parallelize"), "harness/rank/decoder_lm.py", "parallelize_examples",
                      "harness/rank/parallelize_models.py", "harness/rank/torchtitan_llama.py",
                      "harness/rank/torchtitan_form.py", "harness/rank/parallel_dims_stand_in.py",
                      "conformance/parallelize_draws.py")),
    # the audit's rules are stated in each strategy's section of CONTRACT.md ("Communication")
    Capability("audit", COLLECTIVES, "conformance/audit", "audit",
               files=("reference/cost_model.py", "harness/rank/recording.py", "harness/driver/audit.py",
                      "harness/rank/programs/audit.py")),
)
# fmt: on
BY_NAME = {c.name: c for c in CAPABILITIES}
GROUPS = {c.group for c in CAPABILITIES if c.group}


def select(spec: str | None) -> frozenset[str]:
    """The capabilities ``--capability`` names (comma-separated names or groups); every one when
    ``spec`` is None. Raises ValueError naming what is unknown and what exists."""
    if spec is None:
        return frozenset(BY_NAME)
    chosen = set()
    for word in (w.strip() for w in spec.split(",")):
        if word in BY_NAME:
            chosen.add(word)
        elif word in GROUPS:
            chosen.update(c.name for c in CAPABILITIES if c.group == word)
        else:
            raise ValueError(f"--capability: no capability or group {word!r}; known: {', '.join(sorted(GROUPS))} (group), {', '.join(BY_NAME)}")
    return frozenset(chosen)


def provided_names() -> tuple[str, ...]:
    """Every name an implementation may provide, in declaration order, once each."""
    return tuple(dict.fromkeys(name for c in CAPABILITIES for name in c.provides))


def conformance_file_of_mutants(folder: str) -> str:
    """The conformance file that must kill the mutants in mutants/<folder>."""
    for capability in CAPABILITIES:
        if capability.mutants == folder:
            return capability.conformance
    raise KeyError(f"mutants/{folder} belongs to no capability in harness/driver/capabilities.py")
