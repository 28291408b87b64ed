"""The model zoo of the pipeline tests: a stack of Linear + Tanh layers of given widths, built from
a plain spec and a seed so that the driver (for the reference) and every rank (for the
implementation under test) build bitwise the same model, and split into stages by a list of layer
counts. Pure torch.nn: nothing here touches torch.distributed.

Spec: ``{"widths": [w0, w1, ..., wL], "dtype": "float64", "delay_ms": 0.0, "dropout": 0.0}``: layer
k maps w_k features to w_{k+1}; with ``dropout`` p every layer's output is dropped with probability p. With ``delay_ms`` > 0 every layer also sleeps that long in its forward and
twice that long in its backward (a stand-in for compute that does not load the CPU, for the
timing benchmark: F = L_s * delay, B = 2 L_s * delay for a stage of L_s layers).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn


def masked_squared_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The sum of the squared errors over the rows whose target is a number: a row of NaN targets
    is padding, which counts nothing (the pipeline's version of an ignored token)."""
    valid = ~torch.isnan(target).any(-1)
    return ((output[valid] - target[valid]) ** 2).sum()


def valid_rows(target: torch.Tensor) -> int:
    """The rows of ``target`` that are not padding (``masked_squared_error``)."""
    return int((~torch.isnan(target).any(-1)).sum())


LOSSES = {"mse": F.mse_loss, "masked_sum": masked_squared_error}


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class Layer(nn.Module):
    """tanh(x W^T + b), optionally sleeping ``delay_s`` forward and 2 * ``delay_s`` backward, and
    optionally dropped with probability ``dropout`` (always training: the mask from torch's default
    generator)."""

    def __init__(self, inputs: int, outputs: int, delay_s: float = 0.0, dropout: float = 0.0):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs)
        self.delay_s, self.dropout = delay_s, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.linear(x))
        if self.dropout:
            y = F.dropout(y, self.dropout, training=True)
        return _Sleep.apply(y, self.delay_s) if self.delay_s > 0 else y


class TiedLayer(nn.Module):
    """tanh(x W + b) with W the first layer's weight [w1, w0] (``weight`` is that same Parameter):
    the last layer of a model whose output layer is tied to its input layer, as a language model's
    head is tied to its embedding."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight
        self.bias = nn.Parameter(torch.zeros(weight.shape[1], dtype=weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight + self.bias)


def build(spec: dict, seed: int) -> nn.Sequential:
    """The layers of ``spec``, every parameter drawn from ``seed`` in named order from a private
    generator (the global RNG is neither used nor disturbed). ``"tied": true``: the last layer is a
    TiedLayer on the first layer's weight (widths w0, w1, ..., w1, w0)."""
    widths = list(spec["widths"])
    if len(widths) < 2:
        raise ValueError(f"widths {widths} describe no layer (need at least an input and an output width)")
    dtype = getattr(torch, spec.get("dtype", "float64"))
    delay_s = float(spec.get("delay_ms", 0.0)) / 1000.0
    layers = [Layer(a, b, delay_s, float(spec.get("dropout", 0.0))) for a, b in zip(widths[:-1], widths[1:])]
    if spec.get("tied"):
        if len(layers) < 2 or widths[-1] != widths[0] or widths[-2] != widths[1]:
            raise ValueError(f"widths {widths} cannot tie the last layer to the first (need at least two layers, widths w0, w1, ..., w1, w0)")
        layers[-1] = TiedLayer(layers[0].linear.weight)
    model = nn.Sequential(*layers).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, tensor in model.named_parameters():
            fan_in = tensor.shape[-1] if tensor.dim() > 1 else max(tensor.numel(), 1)
            tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float64).to(dtype) * 1.5 / math.sqrt(fan_in))
    return model


def split(model: nn.Sequential, layers_per_stage: list[int]) -> list[nn.Sequential]:
    """Consecutive layers into stages: stage s holds the next ``layers_per_stage[s]`` layers."""
    if sum(layers_per_stage) != len(model) or any(n < 1 for n in layers_per_stage):
        raise ValueError(f"layers per stage {layers_per_stage} do not split {len(model)} layers (each stage needs at least one)")
    stages, start = [], 0
    for n in layers_per_stage:
        stages.append(nn.Sequential(*[model[k] for k in range(start, start + n)]))
        start += n
    return stages


def make_batch(spec: dict, batch_size: int, seed: int) -> dict:
    """{"inputs": [batch, w0], "targets": [batch, wL]} in the spec's dtype."""
    dtype = getattr(torch, spec.get("dtype", "float64"))
    generator = torch.Generator().manual_seed(seed)
    widths = spec["widths"]
    inputs = torch.randn((batch_size, widths[0]), generator=generator, dtype=torch.float64)
    targets = torch.rand((batch_size, widths[-1]), generator=generator, dtype=torch.float64) * 2 - 1
    return {"inputs": inputs.to(dtype), "targets": targets.to(dtype)}


def loss_fn(name: str):
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r} (known: {', '.join(LOSSES)})") from None


class Block(nn.Module):
    """One transformer-style MLP block, y = GELU(x W1^T + b1) W2^T + b2 (h -> ffn -> h; exact GELU,
    reference.tensor_parallel.mlp's formula): the unit a tensor-parallel MLP shards (fc1 by columns,
    fc2 by rows) and the pipeline stacks into stages."""

    def __init__(self, h: int, ffn: int, bias: bool):
        super().__init__()
        self.fc1 = nn.Linear(h, ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def build_blocks(spec: dict, seed: int) -> nn.Sequential:
    """Spec ``{"h": h, "ffn": ffn, "blocks": L, "bias": True, "dtype": "float64"}``: L blocks, every
    parameter drawn from ``seed`` in named order from a private generator (as ``build``)."""
    dtype = getattr(torch, spec.get("dtype", "float64"))
    if spec["blocks"] < 1 or spec["h"] < 1 or spec["ffn"] < 1:
        raise ValueError(f"a block stack needs h, ffn and blocks of at least 1, got {spec}")
    model = nn.Sequential(*[Block(spec["h"], spec["ffn"], spec.get("bias", True)) for _ in range(spec["blocks"])]).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, tensor in model.named_parameters():
            fan_in = tensor.shape[-1] if tensor.dim() > 1 else max(tensor.numel(), 1)
            tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float64).to(dtype) / math.sqrt(fan_in))
    return model


def make_block_batch(spec: dict, batch_size: int, seed: int) -> dict:
    """{"inputs": [batch, h], "targets": [batch, h]} in the spec's dtype."""
    return make_batch({"widths": [spec["h"], spec["h"]], "dtype": spec.get("dtype", "float64")}, batch_size, seed)


class AttentionHolder(nn.Module):
    """The dense attention projections: ``qkv`` (fused, in the spec's layout) and ``out``."""

    def __init__(self, h: int, heads: int, kv_heads: int, head_dim: int, bias: bool):
        super().__init__()
        self.qkv = nn.Linear(h, (heads + 2 * kv_heads) * head_dim, bias=bias)
        self.out = nn.Linear(heads * head_dim, h, bias=bias)


class SwiGLUHolder(nn.Module):
    """The dense SwiGLU projections: ``gate_up`` ([gate | up] rows) and ``down``."""

    def __init__(self, h: int, ffn: int, bias: bool):
        super().__init__()
        self.gate_up = nn.Linear(h, 2 * ffn, bias=bias)
        self.down = nn.Linear(ffn, h, bias=bias)


class TransformerBlockWeights(nn.Module):
    def __init__(self, spec: dict):
        super().__init__()
        self.attn = AttentionHolder(spec["h"], spec["heads"], spec["kv_heads"], spec["head_dim"], spec["bias"])
        self.mlp = SwiGLUHolder(spec["h"], spec["ffn"], spec["bias"])


def build_transformer(spec: dict, seed: int) -> nn.Module:
    """The dense weights of a small language model (the whole-block mesh test): ``embed``
    (nn.Embedding(vocab, h), also the output head: tied) and ``blocks`` of causal self-attention and
    SwiGLU, each with a residual. Spec: {"vocab", "h", "heads", "kv_heads", "head_dim", "ffn",
    "blocks", "bias", "layout", "dtype"}; every parameter drawn from ``seed`` in named order from a
    private generator (as ``build``). The forward is written out in reference/transformer_model.py
    (dense) and harness/rank/programs/mesh_transformer.py (on the implementation's layers)."""
    model = nn.Module()
    model.embed = nn.Embedding(spec["vocab"], spec["h"])
    model.blocks = nn.ModuleList([TransformerBlockWeights(spec) for _ in range(spec["blocks"])])
    model = model.to(getattr(torch, spec.get("dtype", "float64")))
    generator = torch.Generator().manual_seed(seed)
    # the projections back into the residual stream scaled by 1 / (2 L) (GPT-2's residual scaling, here
    # stronger): without a norm, L blocks of unit gain would grow the stream and its gradients
    # geometrically (measured: 1e18 at 8 blocks), past what a relative bound can judge
    residual = 1.0 / (2 * spec["blocks"])
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            fan_in = tensor.shape[-1] if tensor.dim() > 1 else max(tensor.numel(), 1)
            scale = residual if name.endswith(("attn.out.weight", "attn.out.bias", "mlp.down.weight", "mlp.down.bias")) else 1.0
            tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float64).to(tensor.dtype) * scale / math.sqrt(fan_in))
    return model
