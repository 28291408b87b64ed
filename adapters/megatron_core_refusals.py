"""Why megatron-core cannot run some of the contract on CPU ranks: each text is raised as
NotImplementedError("megatron-core cannot ...") on every rank, so the suite refuses the example with
it (conformance/verdict.py, adapter_cannot) and never passes it. The library lines are those of
megatron-core 0.16.1."""

DISTRIBUTED_OPTIMIZER = (
    "megatron-core cannot run its ZeRO-1 (megatron.core.optimizer.DistributedOptimizer) on CPU ranks: "
    "_build_model_and_main_param_groups (optimizer/distrib_optimizer.py) accepts only parameters whose "
    "type() is torch.cuda.FloatTensor, HalfTensor or BFloat16Tensor and raises TypeError for any other; "
    "it also runs only inside get_megatron_optimizer over its DistributedDataParallel's gradient buffers, "
    "not over a plain parameter list"
)
DROPOUT = (
    "megatron-core cannot draw dropout inside its tensor-parallel MLP on CPU ranks: its MLP has no hidden "
    "dropout (Megatron drops out after the block, in bias_dropout_add) and the masks of its sharded region "
    "come from tensor_parallel.get_cuda_rng_tracker(), seeded by model_parallel_cuda_manual_seed, which "
    "calls torch.cuda.manual_seed and forks CUDA generator states"
)
COMPUTE_DTYPE = (
    "megatron-core cannot compute one layer in another dtype than its parameters': its mixed precision "
    "casts the whole model (Float16Module, params_dtype=bf16/fp16) and keeps float32 masters in its "
    "MixedPrecisionOptimizer and float32 main_grad buffers in its DistributedDataParallel"
)
DIVIDE_FACTOR = (
    "megatron-core cannot sum gradients over ranks after every backward of a step: its per-token sum "
    "(calculate_per_token_loss) reduces the whole main_grad buffer once, at the step's last micro-batch "
    "(no_sync around the others), so under the contract's loop the part synchronised earlier would be "
    "summed again"
)
PIPELINE = (
    "megatron-core cannot run its pipeline schedules on CPU ranks: forward_backward_no_pipelining, "
    "forward_backward_pipelining_without_interleaving and _with_interleaving each start with "
    'total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda") (pipeline_parallel/schedules.py), a '
    "device named outright, and its P2PCommunicator calls torch.cuda.synchronize() after batch_isend_irecv"
)
