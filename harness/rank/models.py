"""The model zoo of the data-parallel tests: small models, batches and optimizers built from plain
specs (dicts of ints, strs, bools, floats) and a seed, so the driver (for the reference) and every
rank (for the implementation under test) build bitwise the same thing. Pure torch.nn: nothing here
touches torch.distributed.

A model's forward takes a batch's ``inputs`` and ``targets`` and returns the mean loss over the
batch's samples, so the mean over ranks of per-rank losses on equal slices is the global-batch loss.

* ``mlp``: x -> Linear -> tanh -> Linear, mean squared error. Nothing special.
* ``gelu_mlp``: x -> ``mlp.fc1`` -> exact GELU -> ``mlp.fc2``, mean squared error against targets of
  x's width: the block the tensor-parallel contract's ``TensorParallelMLP.from_dense(fc1, fc2)``
  takes, so one model can be trained data parallel or tensor parallel (the checkpoint tests).
  ``"dropout": p`` drops the hidden activations with probability p (always in training mode), the
  mask drawn from torch's default generator inside the block (the random-stream tests).
* ``stacked_mlp``: ``layers`` Linear(width, width) + tanh layers named ``l0``, ``l1``, ..., mean
  squared error: a model that can be trained data parallel or cut into pipeline stages that keep
  its names (``stage_of``; the checkpoint tests).
* ``tied_lm``: the hard cases of data parallelism in one model:
  - tied weights: the output head's weight *is* the embedding's weight (one Parameter used by two
    modules, reported once by named_parameters as ``embed.weight``);
  - a frozen parameter: ``gain`` (requires_grad=False), multiplies the features before the head;
  - a parameter with no gradient in some steps: ``aux`` is used on odd-numbered calls of forward
    only (1st, 3rd, ...), so on the 2nd, 4th, ... step its .grad stays None and torch's optimizers
    skip it; which calls use it depends only on the ``calls`` counter, the same on every rank.
    ``"skips_first": True`` uses it on even-numbered calls instead: no gradient in the first step
    (an optimizer that partitions or allocates state lazily at its first step never sees it);
    ``"skips_in_unit": True`` makes ``aux`` a module of two parameters, ``aux.scale`` used on every
    call and ``aux.linear.weight`` on the calls above only: a parameter with no gradient inside a
    module that ran (a fully sharded unit reduces its gradients; that parameter must keep None);
  - buffers: ``offset`` (a fixed random vector added to the embeddings) and ``calls`` (a counter
    incremented by every forward).
  Each hard case can be switched off in the spec (``"tied": False``, ``"frozen": False``,
  ``"skips": False``, ``"buffers": False``, which drops ``offset``, and ``calls`` too unless skips
  need it; all on by default), so that a test can isolate one
  property and grade it on its own (partial credit). ``"buffer_seed": k`` draws the buffers from
  seed k instead of the model's seed (ranks that differ in their buffers only). ``"dtype":
  "float64"`` (or another floating dtype) builds every floating parameter, buffer and input in it.
  ``"loss": "sum"`` returns the sum of the per-token losses over the valid targets instead of their
  mean (a target equal to ``IGNORE`` counts nothing): the loss a trainer divides by the global
  token count itself (CONTRACT.md, "Loss normalised by the global token count").
* ``relu_lm``: the model of the compute-dtype tests, on which low precision computes exactly: an
  embedding, Linear -> ReLU -> Linear, an output head (``"tied": True`` ties it to the embedding),
  no bias, every weight in {-1, 0, 1}; its loss is minus the target's logit, averaged over the
  batch's positions (computed in float32 from the logits, whatever their dtype), so it is linear in
  the logits and every product, sum and gradient is an integer multiple of 1/positions.
  ``reference/mixed_precision.py`` says when float16 and bfloat16 then hold every value exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("mlp", "gelu_mlp", "stacked_mlp", "tied_lm", "relu_lm")
IGNORE = -100  # a target that is not a token (padding, a prompt): torch's cross_entropy ignore_index


class MLP(nn.Module):
    def __init__(self, inputs: int, hidden: int, outputs: int):
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, outputs)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(torch.tanh(self.fc1(inputs))), targets)


class GeluBlock(nn.Module):
    def __init__(self, width: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x), approximate="none")
        if self.dropout:  # always training: the mask comes from torch's default generator
            h = F.dropout(h, self.dropout, training=True)
        return self.fc2(h)


class GeluMLP(nn.Module):
    def __init__(self, width: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.mlp = GeluBlock(width, hidden, dropout)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.mlp(inputs), targets)


class StackedMLP(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.depth = layers
        for k in range(layers):
            setattr(self, f"l{k}", nn.Linear(width, width))

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = inputs
        for k in range(self.depth):
            h = torch.tanh(getattr(self, f"l{k}")(h))
        return F.mse_loss(h, targets)


class Stage(nn.Module):
    """Layers ``first`` .. ``last`` - 1 of a StackedMLP, under the model's own names (``l3.weight``),
    as a pipeline stage: forward(x) runs them in order."""

    def __init__(self, model: StackedMLP, first: int, last: int):
        super().__init__()
        self.names = [f"l{k}" for k in range(first, last)]
        for name in self.names:
            setattr(self, name, getattr(model, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.names:
            x = torch.tanh(getattr(self, name)(x))
        return x


def stage_of(model: StackedMLP, stage: int, stages: int) -> Stage:
    """Stage ``stage`` of ``stages`` equal runs of consecutive layers (the depth divides by them)."""
    if model.depth % stages:
        raise ValueError(f"{model.depth} layers do not split into {stages} equal stages")
    each = model.depth // stages
    return Stage(model, stage * each, (stage + 1) * each)


class ScaledResidual(nn.Module):
    """h * scale, plus linear(h * scale) when ``use``: ``scale`` always has a gradient, ``linear``'s
    weight only on the calls that use it."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.linear = nn.Linear(width, width, bias=False)

    def forward(self, h: torch.Tensor, use: bool) -> torch.Tensor:
        h = h * self.scale
        return h + self.linear(h) if use else h


class TiedLM(nn.Module):
    def __init__(
        self,
        vocab: int,
        width: int,
        hidden: int,
        tied: bool = True,
        frozen: bool = True,
        skips: bool = True,
        buffers: bool = True,
        skips_first: bool = False,
        skips_in_unit: bool = False,
        loss: str = "mean",
    ):
        super().__init__()
        if loss not in ("mean", "sum"):
            raise ValueError(f"loss must be 'mean' or 'sum' (over the valid targets), got {loss!r}")
        self.reduction = loss
        self.skips, self.used_on = skips, 0 if skips_first else 1
        self.embed = nn.Embedding(vocab, width)
        self.aux = ScaledResidual(width) if skips_in_unit else nn.Linear(width, width, bias=False)
        self.mlp_in = nn.Linear(width, hidden)
        self.mlp_out = nn.Linear(hidden, width)
        self.gain = nn.Parameter(torch.ones(width), requires_grad=not frozen)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight  # tied: one parameter, two modules
        if buffers:
            self.register_buffer("offset", torch.zeros(width))
        else:
            self.offset = 0.0
        if buffers or skips:  # the counter that decides the skips is state: it travels with the model
            self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        else:
            self.calls = torch.zeros((), dtype=torch.int64)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.embed(inputs) + self.offset
        use = not self.skips or int(self.calls) % 2 == self.used_on  # with skips, aux is left out on every other call
        if isinstance(self.aux, ScaledResidual):
            h = self.aux(h, use)
        elif use:
            h = h + self.aux(h)
        h = h + self.mlp_out(torch.tanh(self.mlp_in(h)))
        logits = self.head(h * self.gain)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE, reduction=self.reduction)


class ReluLM(nn.Module):
    def __init__(self, vocab: int, width: int, hidden: int, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.fc1 = nn.Linear(width, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, width, bias=False)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.fc2(torch.relu(self.fc1(self.embed(inputs)))))
        self.logits_dtype = str(logits.dtype).removeprefix("torch.")  # what a compute dtype's test asks
        return -logits.float().gather(-1, targets.unsqueeze(-1)).mean()


def build(spec: dict, seed: int) -> nn.Module:
    """The model ``spec`` describes, every floating parameter and buffer drawn from ``seed`` (in
    named order, from a private generator: the global RNG is neither used nor disturbed)."""
    kind = spec["kind"]
    if kind == "mlp":
        model = MLP(spec["inputs"], spec["hidden"], spec["outputs"])
    elif kind == "stacked_mlp":
        model = StackedMLP(spec["width"], spec["layers"])
    elif kind == "gelu_mlp":
        model = GeluMLP(spec["width"], spec["hidden"], float(spec.get("dropout", 0.0)))
    elif kind == "tied_lm":
        model = TiedLM(
            spec["vocab"],
            spec["width"],
            spec["hidden"],
            **{k: bool(spec[k]) for k in ("tied", "frozen", "skips", "buffers", "skips_first", "skips_in_unit") if k in spec},
            loss=spec.get("loss", "mean"),
        )
    elif kind == "relu_lm":
        model = ReluLM(spec["vocab"], spec["width"], spec["hidden"], bool(spec.get("tied", False)))
    else:
        raise ValueError(f"unknown model kind {kind!r} (known: {', '.join(KINDS)})")
    if "dtype" in spec:  # floating parameters and buffers in that dtype (the counter stays int64)
        model = model.to(getattr(torch, spec["dtype"]))
    generator = torch.Generator().manual_seed(seed)
    buffer_generator = torch.Generator().manual_seed(spec["buffer_seed"]) if "buffer_seed" in spec else generator
    buffers = {name for name, _ in model.named_buffers()}
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point():
                continue
            if name in buffers:
                tensor.copy_(torch.randn(tensor.shape, generator=buffer_generator) / math.sqrt(max(tensor.numel(), 1)))
                continue
            if kind == "relu_lm":  # integers in {-1, 0, 1}: see reference/mixed_precision.py
                tensor.copy_(torch.randint(-1, 2, tensor.shape, generator=generator))
                continue
            if name == "gain":
                tensor.copy_(1.0 + 0.5 * torch.rand(tensor.shape, generator=generator))
                continue
            fan_in = tensor.shape[-1] if tensor.dim() > 1 else max(tensor.numel(), 1)
            tensor.copy_(torch.randn(tensor.shape, generator=generator) / math.sqrt(fan_in))
    return model


def _floating(spec: dict) -> torch.dtype:
    return getattr(torch, spec.get("dtype", "float32"))


def make_batch(spec: dict, batch_size: int, seed: int) -> dict:
    """A batch of ``batch_size`` samples for the model ``spec`` describes: {"inputs", "targets"},
    both with the batch as their first dimension."""
    generator = torch.Generator().manual_seed(seed)
    if spec["kind"] == "mlp":
        inputs = torch.randn((batch_size, spec["inputs"]), generator=generator).to(_floating(spec))
        targets = torch.randn((batch_size, spec["outputs"]), generator=generator).to(_floating(spec))
    elif spec["kind"] in ("gelu_mlp", "stacked_mlp"):
        inputs = torch.randn((batch_size, spec["width"]), generator=generator).to(_floating(spec))
        targets = torch.randn((batch_size, spec["width"]), generator=generator).to(_floating(spec))
    elif spec["kind"] in ("tied_lm", "relu_lm"):
        shape = (batch_size, spec["context"])
        inputs = torch.randint(0, spec["vocab"], shape, generator=generator)
        targets = torch.randint(0, spec["vocab"], shape, generator=generator)
    else:
        raise ValueError(f"unknown model kind {spec['kind']!r} (known: {', '.join(KINDS)})")
    return {"inputs": inputs, "targets": targets}


def optimizer_class(spec: dict) -> tuple[type, dict]:
    """``{"name": "sgd", "lr", "momentum", "weight_decay"}`` is torch.optim.SGD and
    ``{"name": "adamw", "lr", "betas", "eps", "weight_decay"}`` torch.optim.AdamW, every
    hyperparameter explicit (no defaults): (the class, its keyword arguments)."""
    classes = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
    if spec["name"] not in classes:
        raise ValueError(f"unknown optimizer {spec['name']!r} (known: {', '.join(classes)})")
    return classes[spec["name"]], {k: (tuple(v) if k == "betas" else v) for k, v in spec.items() if k != "name"}


def build_optimizer(spec: dict, params) -> torch.optim.Optimizer:
    """The optimizer ``spec`` describes (see ``optimizer_class``) over ``params``."""
    cls, options = optimizer_class(spec)
    return cls(params, **options)


def tensors_held(parameters: list, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """{kind: tensors}: the trainable ``parameters``, their gradients and the optimizer's state
    tensors (not its scalar step counters)."""
    trainable = [p for p in parameters if p.requires_grad]
    return {
        "parameters": trainable,
        "gradients": [p.grad for p in trainable if p.grad is not None],
        "optimizer_state": [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0],
    }


def dtypes_held(kinds: dict[str, list[torch.Tensor]]) -> dict[str, list[str]]:
    """{kind: the sorted dtype names} of ``tensors_held``'s tensors."""
    return {kind: sorted({str(t.dtype).removeprefix("torch.") for t in tensors}) for kind, tensors in kinds.items()}


def state(model: nn.Module) -> dict:
    """{name: detached copy} of every parameter (a tied one once) and every buffer."""
    return {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def trainable_bytes(model: nn.Module) -> list[int]:
    """Bytes of each parameter that requires a gradient, in registration order (tied ones once)."""
    return [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
