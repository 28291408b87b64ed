"""DeepSpeed's mixed precision behind the contract's ``compute_dtype`` (CONTRACT.md, capability
``dp_compute_dtype``), through DeepSpeed's own flag, as its users turn it on.

``compute_dtype=torch.bfloat16`` is ``"bf16": {"enabled": true}``: ``initialize`` casts the model to
bfloat16 (forward and backward run in it, the gradients are all-reduced in it) and its optimizer
keeps float32 copies of the parameters, which it steps (ZeRO stage 0: FP16_UnfusedOptimizer over
bfloat16 groups, engine.py ``_do_optimizer_sanity_check`` -> DDP_BFLOAT16; its ``step`` takes each
bfloat16 gradient to float32, divides it by the loss scale, 1 for bf16, and copies the stepped
masters back into the model). The contract's parameters are those float32 masters, so ``masters()``
shows them (harness/rank/library_loop.py): each master under its parameter's name, with the gradient
``step`` will hand it, the model's bfloat16 gradient in float32.

``compute_dtype=torch.float16`` is ``"fp16": {"enabled": true, "initial_scale_power": 0}``: its
dynamic loss scaler starts at 2^0 where DeepSpeed's default starts at 2^16 and halves the scale,
skipping the step, at each overflow (runtime/fp16/loss_scaler.py, DynamicLossScaler). Skipping is
its documented design, and the contract's one step must be a step: the suite's examples compute
exactly in float16, so a scale of 1 never overflows, and a power of two scales exactly in any case.
"""

from __future__ import annotations

import torch
from torch import nn


def mixed_precision(compute_dtype) -> dict:
    """The config keys for the contract's ``compute_dtype`` (None: none)."""
    if compute_dtype is None or compute_dtype == torch.float32:
        return {}
    if compute_dtype == torch.bfloat16:
        return {"bf16": {"enabled": True}}
    if compute_dtype == torch.float16:
        return {"fp16": {"enabled": True, "initial_scale_power": 0}}
    raise NotImplementedError(f"DeepSpeed cannot compute in {compute_dtype}: its flags are bf16 and fp16")


def masters(engine, model: nn.Module) -> nn.Module:
    """A module holding, under each of ``model``'s parameter names, the float32 copy DeepSpeed's
    optimizer steps (a detached copy, read now), its ``.grad`` the model's gradient in float32; the
    model's buffers as they are. ``model`` itself where DeepSpeed keeps no copies (float32 training)."""
    named = list(model.named_parameters())
    if not named or named[0][1].dtype == torch.float32:
        return model
    copies = _master_of(engine.optimizer)
    view = nn.Module()
    for name, parameter in named:
        master = copies(parameter)
        held = nn.Parameter(master.detach().clone().reshape(parameter.shape), requires_grad=parameter.requires_grad)
        if parameter.grad is not None:
            held.grad = parameter.grad.detach().float()
        _set(view, name, held)
    for name, buffer in model.named_buffers():
        _set(view, name, buffer.detach().clone(), buffer=True)
    return view


def _master_of(optimizer):
    """parameter -> its float32 master: DeepSpeed's own accessor (ZeRO 1-3 and BF16_Optimizer, through
    each parameter's _hp_mapping or ds_id), else FP16_UnfusedOptimizer's groups side by side."""
    from deepspeed.utils import safe_get_full_fp32_param

    pairs = {}
    for low, high in zip(getattr(optimizer, "fp16_groups", ()), getattr(optimizer, "fp32_groups", ())):
        pairs.update({id(p): q for p, q in zip(low, high)})

    def master(parameter):
        if id(parameter) in pairs:
            return pairs[id(parameter)]
        found = safe_get_full_fp32_param(parameter)
        if found is None:
            raise NotImplementedError(
                f"the DeepSpeed adapter cannot find the float32 master of a {parameter.dtype} parameter under {type(optimizer).__name__}"
            )
        return found

    return master


def _set(root: nn.Module, dotted: str, tensor, buffer: bool = False) -> None:
    *path, leaf = dotted.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if buffer:
        module.register_buffer(leaf, tensor)
    else:
        module.register_parameter(leaf, tensor)
