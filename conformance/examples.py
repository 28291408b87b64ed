"""Hypothesis strategies for the examples the conformance tests draw, and deterministic input
tensors built from them in the driver. An example prints as everything needed to reproduce it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st

import parallelism_conformance.reference.pipeline_schedules as sched
from parallelism_conformance.harness.rank import models
from parallelism_conformance.reference.collectives import DTYPES, op_applies

FLOAT_DTYPES = tuple(d for d in DTYPES if d.is_floating_point)
LARGE_NUMEL = (1000, 5000)  # "several thousand elements"


@dataclass(frozen=True)
class Layout:
    """Which ranks take part: a world of ``world_size`` ranks and the members of the group used
    (global ranks, sorted), or the whole world when ``members`` is None."""

    world_size: int
    members: tuple[int, ...] | None = None

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.members if self.members is not None else tuple(range(self.world_size))

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def group(self) -> list[int] | None:
        return list(self.members) if self.members is not None else None

    def __str__(self) -> str:
        group = "whole world" if self.members is None else f"group {list(self.members)}"
        return f"world_size={self.world_size} ({group})"


PER_MEMBER = "per member"  # a Values whose shapes each test gives per member (all-to-all splits)


@dataclass(frozen=True)
class Values:
    """A recipe for one tensor per group member: dtype, shape (or PER_MEMBER), and how to draw values."""

    dtype: torch.dtype
    shape: tuple[int, ...] | str
    seed: int
    scale: float = 1.0  # magnitude of floating values; integers use the dtype's whole range
    op: str | None = None  # the reduction the values feed, which bounds them where needed

    def tensor(self, index: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        shape = self.shape if shape is None else shape
        if shape == PER_MEMBER:
            raise ValueError("this Values has no shape of its own: pass each member's shape")
        g = torch.Generator().manual_seed(self.seed * 1009 + index)
        if self.dtype.is_floating_point:
            if self.op == "PRODUCT":  # magnitudes in [0.5, 2] keep an 8-way product finite in fp16
                magnitude = torch.rand(shape, generator=g, dtype=torch.float64) * 1.5 + 0.5
                sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
                return (magnitude * sign).to(self.dtype)
            return (torch.randn(shape, generator=g, dtype=torch.float64) * self.scale).to(self.dtype)
        info = torch.iinfo(self.dtype)
        low, high = max(info.min, -(2**62)), min(info.max, 2**62)
        return torch.randint(low, high + 1, shape, generator=g, dtype=torch.int64).to(self.dtype)

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        scale = f" scale={self.scale:g}" if self.dtype.is_floating_point and self.op != "PRODUCT" else ""
        shape = "shapes per member (from the split sizes)" if self.shape == PER_MEMBER else f"shape={self.shape}"
        return f"dtype={dtype} {shape} seed={self.seed}{scale}"


def sentinel(like: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """An output buffer pre-filled with a value no correct collective writes (NaN, or for integers
    the dtype's extreme farthest from zero: the minimum, the maximum for unsigned types, whose
    minimum 0 is a common right answer), so an element the implementation never wrote is caught."""
    shape = tuple(like.shape) if shape is None else shape
    return torch.full(shape, _sentinel_value(like.dtype), dtype=like.dtype)


def _sentinel_value(dtype: torch.dtype):
    if dtype.is_floating_point:
        return float("nan")
    info = torch.iinfo(dtype)
    return info.min if info.min < 0 else info.max


def is_sentinel(value: float, dtype: torch.dtype) -> bool:
    if dtype.is_floating_point:
        return value != value
    return value == _sentinel_value(dtype)


@st.composite
def layouts(draw, max_world_size: int, min_size: int = 1) -> Layout:
    """A world size, and half the time a proper subgroup of it (members need not be 0..k-1).

    sampled_from draws evenly (st.integers drew world_size=1 over half the time) and shrinks
    towards the front of its list: two ranks first, the degenerate single rank last, the whole
    world before a subgroup. Membership is a coin per rank, so subgroups of every size appear."""
    sizes = [n for n in range(max(min_size, 2), max_world_size + 1)] + ([1] if min_size <= 1 else [])
    if not sizes:  # e.g. --backend nccl on a 1-GPU runner: the test is skipped, in the driver, with why
        pytest.skip(
            f"needs a world of at least {min_size} ranks; this run draws at most {max_world_size} "
            "(--max-world-size, or the GPUs visible under --backend nccl)"
        )
    world_size = draw(st.sampled_from(sizes))
    if world_size > min_size and draw(st.booleans()):
        mask = draw(st.lists(st.booleans(), min_size=world_size, max_size=world_size).filter(lambda m: min_size <= sum(m) < world_size))
        return Layout(world_size, tuple(rank for rank, member in enumerate(mask) if member))
    return Layout(world_size)


def numels(multiple_of: int = 1) -> st.SearchStrategy[int]:
    """Empty, small (often not divisible by the group size), and several thousand elements."""
    small = st.integers(min_value=1, max_value=33)
    large = st.integers(*LARGE_NUMEL)
    return st.one_of(st.just(0), small, small, large).map(lambda k: k * multiple_of)


@st.composite
def shapes(draw, multiple_of: int = 1) -> tuple[int, ...]:
    """1-3 dimensional shapes whose first dimension is a multiple of ``multiple_of``."""
    first = draw(numels(multiple_of))
    trailing = draw(st.lists(st.integers(1, 3), max_size=2)) if first < 100 else []
    return (first, *trailing)


def dtypes_for(op: str | None, refused: frozenset = frozenset()) -> list[torch.dtype]:
    return [d for d in DTYPES if (op is None or op_applies(op, d)) and d not in refused]


@st.composite
def values(draw, dtypes: list[torch.dtype], op: str | None = None, shape=None) -> Values:
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(shapes()) if shape is None else shape
    scale = draw(st.sampled_from([1.0, 1e-3, 3e2])) if dtype.is_floating_point else 1.0
    return Values(dtype, shape if shape == PER_MEMBER else tuple(shape), draw(st.integers(0, 2**16)), scale, op)


@st.composite
def schedule_shapes(draw, max_ranks: int, kinds=sched.KINDS, max_v: int = 2) -> tuple[str, int, int, int]:
    """(kind, p, m, v): v > 1 only for interleaved, looped BFS (and random) schedules, v = 2 on the
    V placement (zb-v, dualpipev, random-v), m a multiple of p for interleaved, m >= 2p for dualpipev,
    1 <= m <= 8 otherwise."""
    kind = draw(st.sampled_from(kinds), label="schedule")
    p = draw(st.sampled_from([*range(2, max_ranks + 1), 1]), label="p")  # evenly, as conformance.examples.layouts
    if kind in ("zb-v", "dualpipev", "random-v"):
        v = 2
    elif kind in ("interleaved", "looped-bfs", "random", "random-split"):
        v = draw(st.integers(1, max_v), label="v")
    else:
        v = 1
    if kind == "interleaved":
        m = p * draw(st.integers(1, max(1, 8 // p)), label="m / p")
    elif kind == "dualpipev":  # at least as many microbatches as stages
        m = draw(st.integers(2 * p, max(2 * p, 8)), label="m")
    else:
        m = draw(st.integers(1, 8), label="m")
    return kind, p, m, v


# ------------------------------------------------------------------ models and optimizers
# Specs of harness/rank/models.py, drawn for data parallelism and the sharded optimizer.
# float64 models too: a float32 flatten buffer or all-reduce silently rounds float64 gradients,
# far beyond float64's tolerance (bfloat16 models are not drawn: its unit roundoff times the
# bounds' constant, 512 u = 2, would let a gradient summed instead of averaged pass).
MODEL_DTYPES = st.sampled_from(["float32", "float64"])
model_specs = st.one_of(
    st.fixed_dictionaries(
        {"kind": st.just("mlp"), "inputs": st.integers(1, 6), "hidden": st.integers(1, 12), "outputs": st.integers(1, 4), "dtype": MODEL_DTYPES}
    ),
    # skips_first: aux has no gradient in the first step (a lazy partition or state allocation at
    # the first step never sees it: found by an implementation written from the contract alone);
    # skips_in_unit: the unused parameter sits in a module that ran (a fully sharded unit that
    # reduce-scatters zeros for it gave it a zero .grad, which weight decay then moves: found by
    # another)
    st.fixed_dictionaries(
        {
            "kind": st.just("tied_lm"),
            "vocab": st.integers(2, 12),
            "width": st.integers(1, 8),
            "hidden": st.integers(1, 12),
            "context": st.integers(1, 3),
            "dtype": MODEL_DTYPES,
            "skips_first": st.booleans(),
            "skips_in_unit": st.booleans(),
        }
    ),
)

optimizer_specs = st.one_of(
    st.fixed_dictionaries(
        {
            "name": st.just("sgd"),
            "lr": st.sampled_from([0.05, 0.2]),
            "momentum": st.sampled_from([0.5, 0.9]),
            "weight_decay": st.sampled_from([0.0, 0.01]),
        }
    ),
    # eps = 1e-3, not torch's 1e-8: see the tolerances in reference/data_parallel.py
    st.fixed_dictionaries(
        {
            "name": st.just("adamw"),
            "lr": st.sampled_from([1e-3, 1e-2]),
            "betas": st.just([0.9, 0.999]),
            "eps": st.just(1e-3),
            "weight_decay": st.sampled_from([0.0, 0.01]),
        }
    ),
)


MIB = 2**20


@st.composite
def bucket_sizes(draw, model: dict):
    """None, or a size in bytes from 1 (every parameter alone in its bucket) to the sum of all
    trainable parameters (a single bucket), as MiB (exact: a power-of-two division)."""
    total = sum(models.trainable_bytes(models.build(model, 0)))
    size = draw(st.one_of(st.none(), st.just(1), st.integers(1, total), st.just(total)))
    return None if size is None else size / MIB


def describe_spec(spec: dict, first: str) -> str:
    """``kind=mlp, hidden=3, ...``: a spec's fields, ``first`` first, then by name."""
    return ", ".join(f"{k}={spec[k]}" for k in sorted(spec, key=lambda k: (k != first, k)))


def dense_layers(
    seed: int, dtype: torch.dtype, layers: list[tuple[int, int]], bias: bool, x_shape: tuple[int, ...], g_shape: tuple[int, ...]
) -> dict:
    """Dense Linear weights for each (in, out) of ``layers`` with nn.Linear's init,
    U(-1/sqrt(in), 1/sqrt(in)) (biases too, or None), then an input x and an upstream gradient
    g = dL/dy drawn N(0, 1), all from ``seed`` in that order: {"params": [(W, b)], "x", "g"}."""
    g = torch.Generator().manual_seed(seed)

    def uniform(*shape, fan_in):
        return ((torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) / fan_in**0.5).to(dtype)

    def normal(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)

    params = [(uniform(fan_out, fan_in, fan_in=fan_in), uniform(fan_out, fan_in=fan_in) if bias else None) for fan_in, fan_out in layers]
    return {"params": params, "x": normal(*x_shape), "g": normal(*g_shape)}


# ------------------------------------------------------------------ mixture of experts
@dataclass(frozen=True)
class MixtureExample:
    """A top-1 MoE layer over a layout (conformance/test_expert_parallel.py): float64 router and
    experts, each member's own tokens and their upstream gradient."""

    layout: Layout
    experts_per_rank: int
    h: int
    f: int
    tokens: tuple[int, ...]  # per member
    seed: int

    @property
    def num_experts(self) -> int:
        return self.layout.size * self.experts_per_rank

    def __str__(self) -> str:
        return (
            f"{self.layout}, {self.num_experts} experts ({self.experts_per_rank} per rank), h={self.h}, f={self.f}, "
            f"tokens per member {list(self.tokens)}, float64, seed={self.seed}"
        )

    def tensors(self) -> dict:
        g = torch.Generator().manual_seed(self.seed)

        def uniform(*shape, fan_in):
            return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) / fan_in**0.5

        experts = [
            (
                uniform(self.f, self.h, fan_in=self.h),
                uniform(self.f, fan_in=self.h),
                uniform(self.h, self.f, fan_in=self.f),
                uniform(self.h, fan_in=self.f),
            )
            for _ in range(self.num_experts)
        ]
        router = torch.randn((self.num_experts, self.h), generator=g, dtype=torch.float64)
        xs = [torch.randn((t, self.h), generator=g, dtype=torch.float64) for t in self.tokens]
        grads = [torch.randn((t, self.h), generator=g, dtype=torch.float64) for t in self.tokens]
        return {"router": router, "experts": experts, "xs": xs, "grads": grads}


@st.composite
def mixture_examples(draw, max_world_size: int, min_size: int = 1) -> MixtureExample:
    layout = draw(layouts(max_world_size, min_size), label="layout")
    return MixtureExample(
        layout=layout,
        experts_per_rank=draw(st.integers(1, 2), label="experts per rank"),
        h=draw(st.integers(1, 6), label="h"),
        f=draw(st.integers(1, 6), label="f"),
        tokens=tuple(draw(st.lists(st.integers(0, 6), min_size=layout.size, max_size=layout.size), label="tokens")),
        seed=draw(st.integers(0, 2**16), label="seed"),
    )


@dataclass(frozen=True)
class TrainingExample:
    """A few optimizer steps of a model on n ranks, each with its slice of the global batch
    (conformance/test_sharded_optimizer.py, conformance/test_fully_sharded.py)."""

    world_size: int
    per_rank_batch: int
    model: dict
    steps: int
    optimizer: dict
    seed: int
    data_seed: int

    def __str__(self) -> str:
        return (
            f"world_size={self.world_size}, global_batch={self.world_size * self.per_rank_batch} "
            f"({self.per_rank_batch} per rank), model=({describe_spec(self.model, 'kind')}), steps={self.steps}, "
            f"optimizer=({describe_spec(self.optimizer, 'name')}), seed={self.seed}, data_seed={self.data_seed}"
        )


SHARDED_DIMENSIONS = {
    "mlp": ("hidden", "outputs"),
    "tied_lm": ("vocab", "width", "hidden"),
    "relu_lm": ("vocab", "width", "hidden"),
}  # weights' rows


def handout_fsdp_model(model: dict, n: int) -> dict:
    """The model spec ``model`` as the CS336 2026 handout's FSDP test would train it (--scope
    cs336): float32, every parameter used in every step, nothing tied, frozen or buffered, and
    every weight's first dimension a multiple of the world size ``n`` (the handout's shapes are
    all even, at 2 ranks)."""
    model = {**model, "dtype": "float32"}
    if model["kind"] == "tied_lm":
        model.update({k: False for k in ("tied", "frozen", "skips", "buffers", "skips_first", "skips_in_unit")})
    elif model["kind"] == "relu_lm":
        model["tied"] = False
    model.update({k: -(-model[k] // n) * n for k in SHARDED_DIMENSIONS[model["kind"]]})
    return model


@st.composite
def training_examples(draw, max_world_size: int, min_world_size: int = 1, max_steps: int = 5) -> TrainingExample:
    return TrainingExample(
        world_size=draw(st.integers(min_world_size, max_world_size)),
        per_rank_batch=draw(st.integers(1, 3)),
        model=draw(model_specs),
        steps=draw(st.integers(1, max_steps)),
        optimizer=draw(optimizer_specs),
        seed=draw(st.integers(0, 2**16)),
        data_seed=draw(st.integers(0, 2**16)),
    )
