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


def accumulate(owner, micro_batches: int) -> None:
    """``owner.accumulate(k)`` where it has one, before the loop takes its optimizer: each step will
    run k backwards and then one step. A library that counts micro-batches itself (DeepSpeed's
    ``gradient_accumulation_steps``) is told its count, so that the loop's accumulation is the one its
    users run (a backward per micro-batch, the step at the boundary), not several boundaries a step."""
    hook = getattr(owner, "accumulate", None)
    if callable(hook):
        hook(micro_batches)


def masters(owner, module):
    """What the optimizer steps, to read its gradients and values from: ``owner.masters()`` where it
    has one (DeepSpeed under its bf16 flag keeps the model in bfloat16 and steps float32 copies of
    it inside its optimizer), else ``module`` itself."""
    hook = getattr(owner, "masters", None)
    return hook() if callable(hook) else module


def configure(impl, configuration: dict) -> None:
    """``impl.configure(configuration)``: the keys a library's users set ({dotted key: value}, drawn
    by the driver from the library's table entry; {} = the library's defaults), before a task builds
    anything. Sent only to a library's adapter that declares such keys; one without ``configure``
    is told so by name."""
    hook = getattr(impl, "configure", None)
    if not callable(hook):
        raise NotImplementedError(
            f"the driver sent a library configuration ({sorted(configuration)}) to an implementation without configure(configuration)"
        )
    hook(dict(configuration))
