"""What conformance/test_parallelize.py draws: the meshes (every factorisation of worlds 1 to the
largest over DIMS, those the function declares drawn, the rest skipped naming the dimension they
need) and, per mesh, an example: the model's sizes, rows, sequence length, steps, optimizer, loss
normalisation and seeds (that module's docstring says what each is for).

The model is the one the function declares (harness/rank/parallelize_models.py). The suite's decoder
draws dim, heads and head_dim freely. torchtitan's Llama (harness/rank/torchtitan_llama.py) ties dim
to heads x head_dim and pairs head_dim for ComplexRoPE, so head_dim is 2 (the smallest even one) and
dim follows from the heads drawn; it runs in float32 (parallelize_models.DTYPES says why). The
decoder's draws are unchanged by the second model: its branch draws the same choices in the same
order, so an example Hypothesis saved before still replays."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from parallelism_conformance.harness.rank import torchtitan_llama

DIMS = ("dp_replicate", "dp_shard", "tp")  # the mesh's order, outermost first (torchtitan's)
DIVISIBLE = ("seq", "vocab")  # what a function may declare it needs in multiples of tp


def mesh_choices(dims: tuple[str, ...], max_world_size: int) -> tuple[list[tuple], list[tuple]]:
    """(the meshes drawn, the meshes not drawn): every factorisation of worlds 1..max_world_size over
    DIMS, as ((name, size), ...) over ``dims``; not drawn, those with a dimension not in ``dims`` above 1."""
    drawn, skipped = [], []
    for sizes in itertools.product(range(1, max_world_size + 1), repeat=len(DIMS)):
        if torch.tensor(sizes).prod() > max_world_size:
            continue
        mesh = tuple(zip(DIMS, sizes))
        if all(size == 1 or name in dims for name, size in mesh):
            drawn.append(tuple((name, size) for name, size in mesh if name in dims))
        else:
            skipped.append(mesh)
    return drawn, skipped


def describe_mesh(mesh) -> str:
    return " x ".join(f"{name}={size}" for name, size in mesh)


@dataclass(frozen=True)
class Example:
    mesh: tuple  # ((name, size), ...)
    model: dict
    model_kind: str
    per_replica: int
    seq: int
    steps: int
    optimizer: dict
    normalisation: str  # "mean" (each rank's mean, no padding) or "global_tokens"
    seed: int
    data_seed: int

    @property
    def sizes(self) -> dict:
        return {name: dict(self.mesh).get(name, 1) for name in DIMS}

    @property
    def world_size(self) -> int:
        return int(torch.tensor(list(self.sizes.values())).prod())

    @property
    def dp(self) -> int:
        return self.sizes["dp_replicate"] * self.sizes["dp_shard"]

    def data_index(self, rank: int) -> int:
        """The rank's data-parallel index: init_device_mesh lays ranks out row-major over DIMS."""
        return rank // self.sizes["tp"]

    def __str__(self) -> str:
        return (
            f"mesh {describe_mesh(self.mesh)}, {self.model_kind} model={self.model}, {self.per_replica} rows per replica of {self.seq} tokens, "
            f"{self.steps} steps of {self.optimizer}, loss: {self.normalisation}, seed={self.seed}, data_seed={self.data_seed}"
        )


@st.composite
def examples(draw, mesh: tuple, by_tp: tuple = (), model_kind: str = "decoder") -> Example:
    """``by_tp``: the sizes among DIVISIBLE the function declares it needs in multiples of tp;
    ``model_kind``: the model it declares (harness/rank/parallelize_models.py)."""
    tp = dict(mesh).get("tp", 1)
    kv_heads = tp * draw(st.integers(1, 2), label="key/value heads per tp rank")
    heads = kv_heads * draw(st.integers(1, 2), label="query heads per key/value head")
    if model_kind == torchtitan_llama.MODEL:
        model = {
            "vocab": tp * draw(st.integers(1, 3), label="vocab / tp") if "vocab" in by_tp else draw(st.integers(2, 12), label="vocab"),
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": 2,
            "ffn": tp * draw(st.integers(1 if tp > 1 else 2, 3), label="ffn per tp rank"),
            "layers": draw(st.integers(1, 2), label="layers"),
            "dtype": "float32",
        }
    else:
        model = decoder_spec(draw, tp, heads, kv_heads, by_tp)
    if draw(st.sampled_from(["sgd", "adamw"]), label="optimizer") == "sgd":
        momentum, decay = draw(st.sampled_from([0.0, 0.9]), label="momentum"), draw(st.sampled_from([0.0, 0.01]), label="weight decay")
        optimizer = {"name": "sgd", "lr": 0.1, "momentum": momentum, "weight_decay": decay}
    else:
        decay = draw(st.sampled_from([0.0, 0.1]), label="weight decay")
        optimizer = {"name": "adamw", "lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": decay}
    return Example(
        mesh,
        model,
        model_kind,
        draw(st.integers(1, 2), label="rows per replica"),
        tp * draw(st.integers(1, 2), label="seq / tp") if "seq" in by_tp else draw(st.integers(1, 4), label="seq"),
        draw(st.integers(1, 3), label="steps"),
        optimizer,
        draw(st.sampled_from(["mean", "global_tokens"]), label="loss normalisation"),
        draw(st.integers(0, 2**16), label="seed"),
        draw(st.integers(0, 2**16), label="data_seed"),
    )


def mesh_id(mesh) -> str:
    return "-".join(f"{name}{size}" for name, size in mesh)


def decoder_spec(draw, tp: int, heads: int, kv_heads: int, by_tp: tuple) -> dict:
    """The suite's decoder's sizes (harness/rank/decoder_lm.py), heads already drawn."""
    # a row-parallel layer's input is at least 2 wide: torch 2.13's DTensor cannot flatten [b, 1, 1]
    # sharded on its last dimension ("would remove or reshape sharded dimension 2"), a limit of torch's
    # own plans on a mesh of tp = 1 with seq 1, not of the plan under test
    return {
        "vocab": tp * draw(st.integers(1, 3), label="vocab / tp") if "vocab" in by_tp else draw(st.integers(2, 12), label="vocab"),
        "dim": draw(st.integers(2, 8), label="dim"),
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": draw(st.integers(1 if heads > 1 else 2, 2), label="head_dim"),
        "ffn": tp * draw(st.integers(1 if tp > 1 else 2, 3), label="ffn per tp rank"),
        "layers": draw(st.integers(1, 2), label="layers"),
        "dtype": "float64",
    }


def fixed_example(mesh: tuple, by_tp: tuple = (), model_kind: str = "decoder") -> Example:
    """One small example of ``mesh``, the same on every run (the traffic test's: its bytes are a
    function of the sizes, so one example says them): two layers, two steps of AdamW."""
    tp = dict(mesh).get("tp", 1)
    vocab = 2 * tp if "vocab" in by_tp else 8
    if model_kind == torchtitan_llama.MODEL:
        model = {"vocab": vocab, "heads": tp, "kv_heads": tp, "head_dim": 2, "ffn": 2 * tp, "layers": 2, "dtype": "float32"}
    else:
        model = {"vocab": vocab, "dim": 4, "heads": tp, "kv_heads": tp, "head_dim": 2, "ffn": 2 * tp, "layers": 2, "dtype": "float64"}
    optimizer = {"name": "adamw", "lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    return Example(mesh, model, model_kind, 1, 2 * tp if "seq" in by_tp else 4, 2, optimizer, "mean", 1, 2)
