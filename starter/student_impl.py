"""Starter template: copy this file, implement what you can, and grade it with

    scripts/conformance --impl path/to/student_impl.py --hypothesis-profile=grading --report-dir out

(add ``--capability collectives`` or the capabilities you have done, to run only those). Every name
the suite may call is here and raises NotImplementedError: a capability you have not implemented
scores 0 as "not implemented" and nothing else breaks. CONTRACT.md says what each
function must do. Build the collectives from point-to-point messages (dist.send, dist.recv,
dist.isend, dist.irecv): the communication audit checks that no backend collective is called.
"""

from torch.distributed import ReduceOp


# ----------------------------------------------------------------------------------- collectives
def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    """Copy the tensor of global rank ``src`` into ``tensor`` on every member of ``group``."""
    raise NotImplementedError("broadcast")


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    """Reduce every member's ``tensor`` with ``op``; the result lands in ``tensor`` on global rank ``dst``."""
    raise NotImplementedError("reduce")


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """Reduce every member's ``tensor`` with ``op``; every member gets the same result, bit for bit."""
    raise NotImplementedError("all_reduce")


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    """Member i receives ``scatter_list[i]`` of global rank ``src`` into ``tensor``."""
    raise NotImplementedError("scatter")


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    """Global rank ``dst`` receives member i's ``tensor`` into ``gather_list[i]``."""
    raise NotImplementedError("gather")


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """Every member receives member i's ``tensor`` into ``tensor_list[i]``."""
    raise NotImplementedError("all_gather")


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Every member receives all inputs concatenated along dim 0 in rank order."""
    raise NotImplementedError("all_gather_into_tensor")


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    """Member i receives the reduction over members of their ``input_list[i]``."""
    raise NotImplementedError("reduce_scatter")


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    """Member i receives chunk i (of n equal chunks along dim 0) of the reduction of the inputs."""
    raise NotImplementedError("reduce_scatter_tensor")


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """Member j receives member i's ``input_tensor_list[j]`` into ``output_tensor_list[i]``."""
    raise NotImplementedError("all_to_all")


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    """Like all_to_all on one tensor: ``input`` is split along dim 0 by ``input_split_sizes``
    (equal pieces when None), and pieces arrive in rank order, sized by ``output_split_sizes``."""
    raise NotImplementedError("all_to_all_single")


# ------------------------------------------------------------------------------- data parallelism
# CONTRACT.md, "Data parallelism"
def DataParallel(module, bucket_size_mb=None, gradient_divide_factor=None, compute_dtype=None):
    """Wrap ``module``: broadcast rank 0's parameters and buffers, and make
    ``finish_gradient_synchronization()`` (called after every backward) leave every gradient averaged
    over ranks. With ``bucket_size_mb`` given: buckets of at most that size, each reduced as soon as
    it is full, during backward (CONTRACT.md). With ``gradient_divide_factor`` f: the sum over ranks
    divided by f instead (CONTRACT.md, "Loss normalised by the global token count"). With
    ``compute_dtype`` d: forward and backward in d, the masters and their gradients in theirs."""
    raise NotImplementedError("DataParallel")


# ------------------------------------------------------------------------------ sharded optimizer
# CONTRACT.md, "Sharded optimizer"
class ShardedOptimizer:
    """ZeRO stage 1: ``optimizer_class`` over this rank's share of ``params`` (``.optim``);
    ``step()`` averages gradients over ranks, updates each parameter once, and sends it to all."""

    def __init__(self, params, optimizer_class, group=None, **defaults):
        raise NotImplementedError("ShardedOptimizer")


# ------------------------------------------------------------------ fully sharded data parallelism
# CONTRACT.md, "Fully sharded data parallelism"
def fully_shard(module, group=None, reshard_after_forward=True, compute_dtype=None, gradient_divide_factor=None):
    """ZeRO-3 / FSDP2-style: shard ``module``'s parameters not held by an inner unit (units first,
    then the root); gather them for forward and backward, reduce-scatter their gradients; return it.
    ``reshard_after_forward=False``: keep what forward gathered until backward (gather once).
    ``compute_dtype``: cast each piece to it before gathering and compute in it; the masters, their
    gradients and the optimizer state keep the parameters' dtype. ``gradient_divide_factor`` f: the
    reduce-scattered sum divided by f instead of the group's size."""
    raise NotImplementedError("fully_shard")


def full_parameters(module):
    """{name: full parameter} of a fully sharded module (its pieces all-gathered)."""
    raise NotImplementedError("full_parameters")


def init_sharded(module, seed, device=None):
    """Materialise a model built on the meta device and fully sharded, on ``device``: each rank's
    pieces of the parameters torch.manual_seed(seed) and each submodule's reset_parameters() give
    one process; torch's default generator left as it was. Returns ``module``."""
    raise NotImplementedError("init_sharded")


# ------------------------------------------------------------------------ checkpoints that reshard
# CONTRACT.md, "Checkpoints that reshard"
def save_checkpoint(path, model, optimizer):
    """Every rank: write ``model``'s parameters and buffers and ``optimizer``'s state (fully sharded
    or ZeRO-1, any world size) under the shared directory ``path``; return once all have written."""
    raise NotImplementedError("save_checkpoint")


def load_checkpoint(path, model, optimizer):
    """Every rank: load a checkpoint saved under any layout and world size into ``model`` and
    ``optimizer`` under theirs; raise on every rank for another architecture or a missing file."""
    raise NotImplementedError("load_checkpoint")


# ---------------------------------------------------------- loss normalised by the global token count
# CONTRACT.md, "Loss normalised by the global token count"
def global_token_count(local_count, group=None):
    """The sum over the group's ranks of ``local_count`` (this rank's valid targets of the step), as
    an int: every rank divides its summed loss by it."""
    raise NotImplementedError("global_token_count")


# ------------------------------------------------------------------------------ distributed sampling
# CONTRACT.md, "Distributed sampling"
class DistributedSampler:
    """torch.utils.data.DistributedSampler's signature and rules: each replica yields ceil(N / n)
    indices (floor with drop_last), the epoch padded with repeats; the order depends on seed, epoch
    (``set_epoch``) and replica only."""

    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False, consumed_samples=0):
        # consumed_samples: the world's count of the current epoch already consumed (capability sampler_resume)
        raise NotImplementedError("DistributedSampler")


# -------------------------------------------------------------- gradient clipping by the global norm
# CONTRACT.md, "Gradient clipping by the global norm"
def clip_grad_norm_(module, max_norm, norm_type=2.0, pp_group=None, tied=None):
    """The norm N of every gradient of ``module`` as one vector (each element counted once, wherever
    it lives: a shard on one rank, a replicated or tied parameter once; with ``pp_group``, module
    a list of this rank's pipeline stages, every stage of the pipeline); scale every gradient by
    min(1, max_norm / (N + 1e-6)); return N, the same on every rank."""
    raise NotImplementedError("clip_grad_norm_")


# -------------------------------------------------------------- vocabulary-parallel cross entropy
# CONTRACT.md, "Vocabulary-parallel cross entropy"
class VocabParallelEmbedding:
    """This rank's rows of the embedding table padded to a multiple of the group; forward returns
    the full embeddings of the tokens on every rank (one all-reduce)."""

    @classmethod
    def from_dense(cls, embedding, group=None):
        raise NotImplementedError("VocabParallelEmbedding")


def vocab_parallel_cross_entropy(logits, targets, vocab_size, group=None, label_smoothing=0.0):
    """Per-token cross entropy over a vocabulary split across the group (padded to a multiple of
    its size; the padding columns never reach the softmax), without gathering the logits.
    label_smoothing eps: (1 - eps) on the target, eps / V on every real column (capability
    vocab_label_smoothing; the suite passes it only when it draws eps > 0)."""
    raise NotImplementedError("vocab_parallel_cross_entropy")


# ----------------------------------------------------------------------------- expert parallelism
# CONTRACT.md, "Expert parallelism"
class ExpertParallelMoE:
    """Top-1 mixture of experts, E/n experts per rank; tokens travel by all-to-all with unequal splits."""

    @classmethod
    def from_dense(cls, router, experts, group=None, top_k=1, compute_aux_loss=False, capacity_factor=None, sequence_parallel=False):
        # top_k and compute_aux_loss (.aux_loss after forward): CONTRACT.md, capability moe_topk;
        # capacity_factor: moe_capacity; sequence_parallel (the router's gradient whole on every member):
        # moe_sequence_parallel
        raise NotImplementedError("ExpertParallelMoE")


# --------------------------------------------------------------------------- context parallelism
# CONTRACT.md, "Context parallelism"
def context_parallel_attention(q, k, v, seq_len, causal=False, group=None):
    """This rank's rows of attention over the whole sequence (rank i holds chunks i and 2n-1-i of 2n):
    ring attention, K/V blocks passed around the group, combined by the online-softmax rule."""
    raise NotImplementedError("context_parallel_attention")


# ----------------------------------------------------------------------------- tensor parallelism
# CONTRACT.md, "Tensor parallelism"
class ColumnParallelLinear:
    """Keeps rows r of the dense weight (output features split); optional all-gather of the output."""

    @classmethod
    def from_dense(cls, linear, group=None, gather_output=False):
        raise NotImplementedError("ColumnParallelLinear")


class RowParallelLinear:
    """Keeps columns r of the dense weight (input features split); all-reduces partial outputs, bias once."""

    @classmethod
    def from_dense(cls, linear, group=None, input_is_parallel=True):
        raise NotImplementedError("RowParallelLinear")


class TensorParallelMLP:
    """Column, GELU, row through Megatron's f and g operators; optionally sequence parallel."""

    @classmethod
    def from_dense(cls, fc1, fc2, group=None, sequence_parallel=False, norm=None, dropout=0.0, compute_dtype=None):
        # norm: a LayerNorm before fc1, held whole on every rank (CONTRACT.md, capability tp_norm)
        # dropout: the dense block's two dropout masks, each member its part (capability tp_dropout)
        # compute_dtype: float32 masters cast where used; the SP bias gradient summed in float32 (tp_compute_dtype)
        raise NotImplementedError("TensorParallelMLP")


class TensorParallelAttention:
    """Causal self-attention with a fused QKV projection and grouped-query attention, split by head:
    each rank its query heads and their key/value heads (CONTRACT.md, capability tp_attention)."""

    @classmethod
    def from_dense(cls, qkv, out, num_heads, num_kv_heads, group=None, sequence_parallel=False, qkv_layout="concatenated"):
        raise NotImplementedError("TensorParallelAttention")


class TensorParallelSwiGLU:
    """down(silu(gate) * up) with a fused [gate | up] projection: each rank rows r of the gate's and of
    the value's (CONTRACT.md, capability tp_swiglu)."""

    @classmethod
    def from_dense(cls, gate_up, down, group=None, sequence_parallel=False):
        raise NotImplementedError("TensorParallelSwiGLU")


# --------------------------------------------------------------------------- pipeline parallelism
# CONTRACT.md, "Pipeline parallelism"
def sync_tied_gradients(stages, tied, group=None):
    """After the step's pipeline_step calls: every copy of a weight tied across stages (``tied``:
    (stage index, parameter name) per use) gets the sum of the distinct copies' gradients
    (CONTRACT.md, capability pipeline_tied)."""
    raise NotImplementedError("sync_tied_gradients")


def split_stages(model, num_stages):
    """The children of ``model`` (an nn.Sequential of L layers) cut into ``num_stages`` contiguous
    stages in order, the first L mod S one layer longer, each an nn.Sequential of the model's own
    layers; L < S: ValueError naming both (CONTRACT.md, "Splitting a model into stages")."""
    raise NotImplementedError("split_stages")


def pipeline_step(stages, inputs, targets, loss_fn, num_microbatches, schedule="1f1b", group=None, placement=None, scale_grads=True):
    """Run one training step of the pipeline; every stage parameter ends with the gradient of the
    mean over microbatches of the loss; the rank holding the last stage returns that loss. Zero
    bubble (capability zero_bubble): schedule="zb-h1", and callable schedules whose backward is
    split into I (input gradient) and W (weight gradient). The V (capability zero_bubble_v):
    schedule="zb-v", or placement="v" with a callable: rank r holds stages r and 2p - 1 - r."""
    raise NotImplementedError("pipeline_step")


def generate_schedule(kind, num_ranks, num_microbatches, stages_per_rank=1):
    """One list of compact actions ("0F3", "1SEND_B2", ...) per rank, for "gpipe", "1f1b" or
    "interleaved" (capability pipeline_schedules), "zb-h1" with "0I3", "0W3" (capability zero_bubble),
    and "zb-v" with stages_per_rank=2 on the V placement (capability zero_bubble_v)."""
    raise NotImplementedError("generate_schedule")


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("dist", "ReduceOp")]
