"""DeepSpeed's entry in the library table (harness/driver/libraries/table.py): the keys its users set,
its runs, its documented designs, and why each failure or refusal of its runs is what it is, with the
standalone reproductions in tests/libraries/ that show DeepSpeed's own behaviour without the suite.
Its own file because its explanations are most of it."""

from __future__ import annotations

from parallelism_conformance.harness.driver.libraries.library import ANY_STAGE, ZERO3, ZERO12, Library, Run, Setting

# The keys DeepSpeed's users set (runtime/zero/config.py's DeepSpeedZeroConfig and runtime/constants.py,
# 0.19.8; the default first). Each leaves the contract's values as they are: bucket sizes, overlap,
# partition order and where the average is divided change how the same sum is reduced, not what it is.
# A finding (2026-12-07, 0.19.8), shown without the suite: ZeRO-3, and ZeRO-1/2 with the optimizer
# offloaded, step a parameter no forward used in a step with its last gradient again
STALE_GRADIENT = (
    "a parameter no forward used in a step (aux.weight, used on every other call) is stepped with the gradient of "
    "the last step that used it: ZeRO-3's flat gradient buffer keeps each parameter's slice from its last backward "
    "(stage3.py: the epilogue hands the optimizer every trainable parameter's __param_id_to_grad_partition slice, "
    "zero_grad clears only param.grad), and the offloaded ZeRO-1/2 path keeps its CPU partitions the same way. Neither "
    "the contract (no gradient, no step) nor DeepSpeed's documented design (a zero gradient, as ZeRO-0 and ZeRO-1/2 "
    "without offload do) moves it so. Shown without the suite by tests/libraries/"
    "deepspeed_stale_gradient_of_a_skipped_parameter.py 3 (and '1 offload', '2 offload'): DeepSpeed matches a "
    "one-process AdamW handed the last gradient again to the bit, at 2 ranks. No upstream issue found"
)
_BUCKET = 500_000_000  # reduce_bucket_size and allgather_bucket_size: pp_int(5e8) elements
DEEPSPEED_SETTINGS = (
    Setting(
        "prescale_gradients", (False, True), ANY_STAGE, "divide the gradients before the all-reduce instead of after (engine.allreduce_bucket)"
    ),
    Setting("gradient_predivide_factor", (1.0, 2.0), ANY_STAGE, "divide by f before the reduction and by n/f after (engine.allreduce_bucket)"),
    Setting(
        "zero_optimization.contiguous_gradients", (True, False), ZERO12 + ZERO3, "copy each gradient into one flat buffer as it is produced"
    ),
    Setting(
        "zero_optimization.overlap_comm",
        (False, True),
        ZERO12,
        "reduce buckets on a side stream while backward goes on (stage 1-2 default: off)",
    ),
    Setting("zero_optimization.overlap_comm", (True, False), ZERO3, "stage 3's default: on"),
    Setting("zero_optimization.reduce_scatter", (True, False), ZERO12, "reduce or reduce-scatter the buckets instead of all-reducing them"),
    Setting(
        "zero_optimization.reduce_bucket_size",
        (_BUCKET, 64),
        ZERO12 + ZERO3,
        "elements reduced at a time: 64 makes a bucket per few parameters",
    ),
    Setting("zero_optimization.allgather_bucket_size", (_BUCKET, 64), ZERO12, "elements all-gathered at a time after the step"),
    Setting("zero_optimization.round_robin_gradients", (False, True), ZERO12, "assign the gradients to the partitions round robin"),
    Setting(
        "zero_optimization.use_multi_rank_bucket_allreduce",
        (True, False),
        ZERO12,
        "all-reduce the ranks' buckets together instead of a reduce each",
    ),
    Setting(
        "zero_optimization.stage3_prefetch_bucket_size",
        (50_000_000, 0),
        ZERO3,
        "elements gathered ahead of the module that needs them (0: none)",
    ),
    Setting("zero_optimization.stage3_max_live_parameters", (1_000_000_000, 64), ZERO3, "elements kept gathered at once before release"),
    Setting(
        "zero_optimization.stage3_max_reuse_distance",
        (1_000_000_000, 0),
        ZERO3,
        "keep a gathered parameter for reuse within this distance (0: never)",
    ),
    Setting(
        "managed_gradient_accumulation",
        (True, False),
        ZERO12 + ZERO3,
        "false: backward only accumulates and step() reduces and updates (engine.step: 'Unmanaged boundary'); not drawn for "
        "ZeRO-0, which then reduces inside step(), after the contract reads the synchronised gradients",
        since="0.19.4",  # constants.py: MANAGED_GRADIENT_ACCUMULATION first in 0.19.4 (absent in 0.19.3)
    ),
)

DEEPSPEED = Library(
    name="deepspeed",
    settings=DEEPSPEED_SETTINGS,
    averages_micro_batches="runtime/engine.py, backward: 'loss = loss / self.gradient_accumulation_steps() if scale_wrt_gas', "
    "and the adapter makes the loop's k micro-batches DeepSpeed's gradient_accumulation_steps (CONTRACT.md, accumulate)",
    by_design={
        "unused_parameters_get_zero_grad": (
            "a parameter no forward used gets a zero gradient, reduced and stepped like any other (weight decay moves it)",
            "runtime/engine.py, _get_gradients_for_reduction: 'if param.grad is None: ... param.grad = torch.zeros(...)', so "
            "'every rank is reducing the same size'; ZeRO-1/2 fill its slot of the flat partition with zeros "
            "(runtime/zero/stage_1_and_2.py, get_all_grad_tensors), ZeRO-3 likewise (stage3.py, set_none_gradients_to_zero); "
            "0.19.8, shown standalone by tests/libraries/deepspeed_unused_parameter_moves.py",
        )
    },
    reproductions={
        "0.19.8": (
            "deepspeed_buffers_not_broadcast.py",
            "deepspeed_unused_parameter_moves.py",
            "deepspeed_stale_gradient_of_a_skipped_parameter.py",
            "deepspeed_fp16_optimizer_steps_at_initialize.py",
            "deepspeed_zero1_overlap_comm_boundary_skips_a_parameter.py",
        ),
        "0.18.3": ("deepspeed_zero2_noncontiguous_gradients_not_reduced.py",),
        "0.18.2": ("deepspeed_zero2_accumulation_keeps_the_last_micro_batch.py",),
        "0.18.5": ("deepspeed_zero0_bf16_gradient_divided_by_loss_scale.py",),
    },
    pinned="0.19.8",
    # known-buggy releases and their fixes: 0.18.2 and 0.18.3 (deepspeedai/DeepSpeed#7718, ZeRO-2 accumulation),
    # 0.18.5 and 0.18.6 (#7837 / #7839, bf16 at ZeRO-0 divides the gradients by 65536)
    older=("0.18.6", "0.18.5", "0.18.3", "0.18.2"),
    # deepspeed.init_distributed JIT-builds its deepspeed_shm_comm op on every machine (about 100 s
    # the first time, cached in ~/.cache/torch_extensions); a compiler that fails is an error there
    system_packages={"g++": "g++", "ninja": "ninja-build"},
    # the op init_distributed builds (comm/torch.py), built here: a rank building it cold (70 s and
    # more on 2 shared cores) outlasts the suite's 60 s rank deadline
    warm_up="from deepspeed.comm.torch import build_shm_op; build_shm_op()",
    runs=(
        Run("ZeRO-0", "parallelism_conformance.adapters.deepspeed", ("data_parallel", "dp_compute_dtype")),
        Run("ZeRO-1", "parallelism_conformance.adapters.deepspeed", ("sharded_optimizer",)),
        Run("ZeRO-1 + offload_optimizer cpu", "parallelism_conformance.adapters.deepspeed_offload", ("sharded_optimizer",)),
        Run("ZeRO-2", "parallelism_conformance.adapters.deepspeed_zero2", ("sharded_optimizer",)),
        Run("ZeRO-2 + offload_optimizer cpu", "parallelism_conformance.adapters.deepspeed_zero2_offload", ("sharded_optimizer",)),
        Run("ZeRO-3", "parallelism_conformance.adapters.deepspeed", ("fully_sharded", "zero2")),
        Run("ZeRO-3 + offload_optimizer cpu", "parallelism_conformance.adapters.deepspeed_offload", ("fully_sharded", "zero2")),
    ),
    explained={
        "test_data_parallel.py::test_compute_dtype_in_data_parallelism_keeps_float32_masters": "a finding (2026-12-07, "
        "0.19.8), wrong where the optimizer decays weights: under bf16 or fp16 at ZeRO stage 0, initialize steps the "
        "client's optimizer once with zero gradients (runtime/fp16/unfused_optimizer.py: FP16_UnfusedOptimizer.__init__ -> "
        "initialize_optimizer_states -> self.optimizer.step()), so SGD's weight decay (and AdamW's, which also counts the "
        "step) moves the float32 masters by lr * wd * p before the first real step: shrunk to world 1, one micro-batch, "
        "SGD weight_decay 1/16, expected 1.1171875, got 1.10943603515625. ZeRO-1/2/3 stopped stepping at initialize "
        "(DeepSpeed#5104) and BF16_Optimizer too (#6485); bf16 at stage 0 reached this optimizer through #7515. Shown "
        "without the suite by tests/libraries/deepspeed_fp16_optimizer_steps_at_initialize.py; no upstream issue found "
        "for the unfused path. On 0.18.5 a second bug fails it without weight decay: bf16's step divides every gradient "
        "by the loss scale 65536 that backward never applied (DeepSpeed#7837, fixed by #7839 in 0.18.6); a ci run shrank "
        "to it once (SGD without weight decay, bf16, world 1: expected 1.125, got 1.0000019073486328) and once to the "
        "initialize finding (fp16, weight decay 1/16), both minimal, so a row shows either; shown without the suite by "
        "tests/libraries/deepspeed_zero0_bf16_gradient_divided_by_loss_scale.py (exit 0 on 0.18.5, 1 on 0.19.8)",
        "test_data_parallel.py::test_buffers_start_from_rank_0s": "DeepSpeed's engine broadcasts rank 0's parameters at initialize and never its buffers "
        "(engine._broadcast_model iterates self.module.named_parameters() only); the contract, as torch's DDP, makes "
        "every rank hold rank 0's buffers. Shown without the suite by tests/libraries/"
        "deepspeed_buffers_not_broadcast.py. A contract question (DeepSpeed documents no buffer broadcast); no "
        "upstream issue found",
        "test_data_parallel.py::test_ranks_start_from_rank_0s_parameters": "the buffers, as in test_buffers_start_from_rank_0s (the example seeds each rank's buffers apart)",
        "test_data_parallel.py::test_training_matches_one_process_on_the_global_batch": "the buffers, as in test_buffers_start_from_rank_0s, or the unused parameter, as in "
        "test_tied_frozen_and_unused_parameters (the first failing example says which)",
        "test_data_parallel.py::test_tied_frozen_and_unused_parameters": "DeepSpeed gives every trainable parameter without a gradient a zero one before reducing "
        "(engine._get_gradients_for_reduction: 'we must create empty grads'), so a parameter no forward used has "
        ".grad zeros and AdamW's weight decay or momentum moves it, where one process and torch's DDP leave it "
        "None (pytorch/pytorch#28294 is the same question for DDP). Shown by tests/libraries/"
        "deepspeed_unused_parameter_moves.py 0. A contract question: DeepSpeed chose it deliberately",
        "test_data_parallel.py::test_gradient_accumulation_and_both_zero_grad_modes": "the unused parameter, as in test_tied_frozen_and_unused_parameters "
        "(aux.weight, which no forward uses, has a .grad after the step's synchronisation)",
        # explained per run first: matrix.explanation takes the first key that matches
        "ZeRO-1 + offload_optimizer cpu: test_sharded_optimizer.py": STALE_GRADIENT,
        "ZeRO-1: test_sharded_optimizer.py::test_sharded_training_matches_one_process_in_the_configurations_users_set": "a finding "
        "(2026-12-07, 0.19.8 and 0.18.3): ZeRO-1 with overlap_comm and gradient accumulation steps wrong when the boundary "
        "micro-batch does not use a parameter that earlier micro-batches of the step used (the brief profile's example: 3 "
        "micro-batches, aux.linear.weight used on every other call, overlap_comm among four keys away from the defaults; "
        "each key toggled alone, overlap_comm is the one: 0.5503676534 against 0.5497514009). Stage 1 reduces from the "
        "gradient hooks only at the boundary and reduce_gradients walks the parameters only 'if not self.overlap_comm' "
        "(runtime/zero/stage_1_and_2.py). Shown without the suite by tests/libraries/"
        "deepspeed_zero1_overlap_comm_boundary_skips_a_parameter.py: off one process by 0.047 with it, 6e-08 without; "
        "exact at ZeRO-2, with 2 micro-batches, or with the parameter used every call. No upstream issue found "
        "(overlap_comm for stage 1 came with DeepSpeed#4887). 0.18.2 to 0.18.6 also fail as ZeRO-2's: contiguous_gradients false "
        "leaves each partition's gradient unreduced (tests/libraries/deepspeed_zero2_noncontiguous_gradients_not_reduced.py; the "
        "same at stage 1, measured)",
        "ZeRO-2: test_sharded_optimizer.py::test_sharded_training_matches_one_process_in_the_configurations_users_set": "0.18.2: "
        "deepspeedai/DeepSpeed#7718, ZeRO-2 with gradient_accumulation_steps > 1 steps on the last micro-batch's gradient over k "
        "(shrunk to world 1, a 1-1-1 MLP, 2 micro-batches, every drawn key at its default), reproduced without the suite by "
        "tests/libraries/deepspeed_zero2_accumulation_keeps_the_last_micro_batch.py; fixed in 0.18.3, where that script matches "
        "the mean. A second finding (2026-12-07) on 0.18.2 to 0.18.6, ZeRO-1 and ZeRO-2: "
        "with contiguous_gradients false, a rank steps its partition on its own local gradient, never reduced with the other "
        "ranks' (the brief profile's 0.18.3 example: world 2, the MLP, three keys away from the defaults; each toggled alone, "
        "contiguous_gradients is the one: fc1.weight -0.12976781 against -0.15172067 after step 1). Shown without the suite by "
        "tests/libraries/deepspeed_zero2_noncontiguous_gradients_not_reduced.py: exit 0 on 0.18.3, where rank 0's step is its "
        "own gradient's to 1e-6, and 1 on 0.19.8, right with either value (the fixing release between them not bisected)",
        "ZeRO-2 + offload_optimizer cpu: test_sharded_optimizer.py": STALE_GRADIENT,
        "test_fully_sharded.py::test_training_matches_one_process": STALE_GRADIENT,
        "test_sharded_optimizer.py::test_sharded_training_matches_one_process_with_the_whole_state": "ZeRO-1/2 pad each flat fp32 partition group to a multiple "
        "of 2n elements (stage_1_and_2.py: alignment = nccl_start_alignment_factor * world size, '4-byte "
        "alignment/sizeof(fp16) = 2') and hold optimizer state for the padding: the contract allows it "
        "(K(2n - 1) elements, since issue 56; before, 140 state elements against 139 read 'replicated'). "
        "What remains is the unused parameter (aux.weight) stepped by weight decay: differs by design "
        "(the table's by_design)",
        "test_fully_sharded.py::test_a_parameter_unused_inside_a_unit_that_ran_keeps_no_gradient": "the unused parameter inside a unit, as in test_training_matches_one_process_and_memory_is_sharded",
        "ZeRO-0: test_data_parallel.py::test_data_parallel_step": "a false failure of the suite's library runner, fixed in harness/driver/libraries/venvs.py: the warm-up "
        "built deepspeed_shm_comm with Debian's ninja (1.11) and the ranks, with the venv's own ninja (1.13) first "
        "on PATH, took that build for out of date and rebuilt the op inside the first audited task, so the kernel "
        "counted about 3 MB of compiler output (3,113,772 B at n=2) as communication. The warm-up and the ranks "
        "now share one PATH, and ZeRO-0's audit passes on 0.19.8 (smoke profile, max world 2: 2 passed); a fail "
        "row here was measured before the fix",
        "test_sharded_optimizer.py::test_sharded_optimizer_step": "ZeRO-1 and ZeRO-2 (with or without offload) all-reduce the gradients (allreduce x2, 1460 B in at n=2 on "
        "tied_lm) and then all-gather the updated partitions (728 B): 2192 B against the 1472 B of a "
        "reduce-scatter and an all-gather (1.49x). DeepSpeed's documented default does it: "
        "zero_optimization.use_multi_rank_bucket_allreduce is true (runtime/zero/config.py: 'Combine the reduce "
        "buckets of the different ranks and do an All-Reduce instead of multiple Reduce ops', meant for small "
        "models on many GPUs), so stage_1_and_2.py's average_tensor all-reduces each bucket "
        "(allreduce_and_scatter) and every rank keeps its slice: 3 parameter volumes of traffic where the ZeRO "
        "paper's reduce-scatter and all-gather move 2 (1.5x). Read in 0.18.3's and 0.19.6's source. The "
        "values are right: costs more (1.49x), a failure only under --require-bounds",
        "test_fully_sharded.py::test_fully_sharded_step": "ZeRO-3's traffic goes through torch.distributed, so it is audited: its optimizer step all-reduces one "
        "scalar (8 B: the overflow / norm check of DeepSpeed's step, which the contract's 'the step sends "
        "nothing' does not allow), and the step's forward and backward add two 4-byte broadcasts "
        "(zero/utils.py assert_ints_same_as_other_ranks: ZeRO-3 checks that every rank recorded the same module "
        "trace) and, on the MLP, gathers beyond two per unit (1.14x the bound: the first step has no recorded "
        "trace to prefetch and release by)",
    },
)
