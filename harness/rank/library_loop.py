"""The contract's training loop where a library trains through its own object (CONTRACT.md,
"Libraries that train through their own object"): each hook is optional, and where the object
lacks it the loop is the plain one (``loss.backward()``, the loop's own optimizer, the model itself)."""

from __future__ import annotations


def backward(owner, loss) -> None:
    """``owner.backward(loss)`` (DeepSpeed's ``engine.backward``) where it has one, else ``loss.backward()``."""
    hook = getattr(owner, "backward", None)
    if callable(hook):
        hook(loss)
    else:
        loss.backward()


def take_optimizer(owner, optimizer):
    """What the loop steps and zeroes: ``owner.take_optimizer(optimizer)`` where it has one (the
    engine built around the loop's optimizer), else the loop's optimizer."""
    hook = getattr(owner, "take_optimizer", None)
    return hook(optimizer) if callable(hook) else optimizer


def wrap_model(optimizer, model):
    """The module the loop runs forward on: ``optimizer.wrap_model(model)`` where the sharded
    optimizer has one (DeepSpeed's engine, fairscale's ShardedDataParallel), else the model."""
    hook = getattr(optimizer, "wrap_model", None)
    return hook(model) if callable(hook) else model
