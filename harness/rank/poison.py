"""The poison an output holds while its communication is in flight under --perturb-timing
(harness/rank/perturbation.py), and how the driver reads it back out of a rank's results.

Floating point: a signaling NaN whose payload names the call, so that a read before completion
shows in the numbers at once and says which call it was. IEEE 754 arithmetic on x86 and ARM
propagates a NaN operand's payload, quieted (measured on torch 2.13 CPU: x*2, x+1, -x, relu, exp,
sqrt, gelu, sum, softmax and a matmul all kept the payload), and a copy keeps the NaN signaling: an
output still signaling, bit for bit, at completion was not written by the program while in flight
(``intact``), where an accumulation into it (``+=``) would have quieted it. float32 carries
``SIGNATURE`` in payload bits 21-16, the rank in bits 15-12 and the rank's call number in bits
11-0; float64 the same fields wider. float16 and bfloat16 have too few bits to name a call:
they get a NaN with a short signature, found but unnamed. Integers get a sentinel pattern
(0x5A5A in the top 16 bits of int32/int64, the call below it), which arithmetic does not keep, so
only a copied value is named. bool and the 8/16-bit integers are not poisoned (no pattern a real
value could not hold). A value that only passes through arithmetic no IEEE rule covers (a library
that returns the canonical NaN) is found as an unnamed NaN.
"""

from __future__ import annotations

import torch

SIGNATURE = 0x29  # 6 bits: a NaN with these payload bits is this module's
_F32 = 0x7F800000 | (SIGNATURE << 16)  # exponent all ones, quiet bit clear: signaling
_F64 = 0x7FF0000000000000 | (SIGNATURE << 40)
_INT = 0x5A5A
_HALF = {torch.float16: 0x7C29, torch.bfloat16: 0x7FA9}
_AS_INT = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def bits(dtype: torch.dtype, rank: int, index: int) -> int | None:
    """The poison's bits (as the same-size integer) for call ``index`` of ``rank``; None: not poisoned."""
    if dtype == torch.float32:
        return _signed32(_F32 | ((rank & 0xF) << 12) | (index & 0xFFF))
    if dtype == torch.float64:
        return _signed64(_F64 | ((rank & 0xFF) << 32) | (index & 0xFFFFFFFF))
    if dtype in _HALF:
        return _HALF[dtype] - (1 << 16) if _HALF[dtype] & 0x8000 else _HALF[dtype]
    if dtype == torch.int32:
        return _signed32((_INT << 16) | ((rank & 0xF) << 12) | (index & 0xFFF))
    if dtype == torch.int64:
        return _signed64((_INT << 48) | ((rank & 0xFFFF) << 32) | (index & 0xFFFFFFFF))
    return None


def fill(tensor: torch.Tensor, rank: int, index: int) -> None:
    """Write the poison of call ``index`` of ``rank`` into ``tensor``, in place, leaving its autograd
    version counter as it was (the real backend writes without bumping it: a correct program that
    saved the tensor for backward must not see an in-place error the backend would not raise)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    value = bits(tensor.dtype, rank, index)
    if value is None or tensor.numel() == 0:
        return
    version = tensor._version
    with torch.no_grad():
        target = tensor.detach()
        (target.view(_AS_INT[tensor.dtype]) if tensor.is_floating_point() else target).fill_(value)
    torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))


def intact(tensor: torch.Tensor, rank: int, index: int) -> bool:
    """Whether ``tensor`` still holds, bit for bit, the poison ``fill`` wrote (True where none was written)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    value = bits(tensor.dtype, rank, index)
    if value is None or tensor.numel() == 0:
        return True
    raw = tensor.detach().view(_AS_INT[tensor.dtype]) if tensor.is_floating_point() else tensor.detach()
    return bool((raw == value).all())


def copy_back(tensor: torch.Tensor, source: torch.Tensor) -> None:
    """tensor <- source in place, its version counter kept (as ``fill``)."""
    version = tensor._version
    with torch.no_grad():
        tensor.detach().copy_(source)
    torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))


def found(tensor: torch.Tensor) -> tuple[set[tuple[int, int]], int]:
    """The (rank, call) pairs whose poison ``tensor`` holds, and how many NaNs of a half-precision
    tensor it holds (a poison there names no call). A float32 or float64 NaN without the signature
    is not counted: it is not this module's (the data's own, or a library's canonical NaN)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.numel() == 0:
        return set(), 0
    tensor = tensor.detach().reshape(-1)
    if tensor.dtype in (torch.float32, torch.float64):
        nan = torch.isnan(tensor)
        if not bool(nan.any()):
            return set(), 0
        raw = tensor[nan].view(_AS_INT[tensor.dtype]).tolist()
        if tensor.dtype == torch.float32:  # quiet or signaling, either sign: the signature bits decide
            return {((w >> 12) & 0xF, w & 0xFFF) for w in raw if ((w >> 16) & 0x3F) == SIGNATURE}, 0
        return {((w >> 32) & 0xFF, w & 0xFFFFFFFF) for w in raw if ((w >> 40) & 0x3F) == SIGNATURE}, 0
    if tensor.dtype in _HALF:
        nan = torch.isnan(tensor)
        return set(), int(nan.sum())
    if tensor.dtype == torch.int32:
        hit = tensor[((tensor >> 16) & 0xFFFF) == _INT].tolist()
        return {((w >> 12) & 0xF, w & 0xFFF) for w in hit}, 0
    if tensor.dtype == torch.int64:
        hit = tensor[((tensor >> 48) & 0xFFFF) == _INT].tolist()
        return {((w >> 32) & 0xFFFF, w & 0xFFFFFFFF) for w in hit}, 0
    return set(), 0


def _signed32(value: int) -> int:
    return value - (1 << 32) if value & 0x80000000 else value


def _signed64(value: int) -> int:
    return value - (1 << 64) if value & (1 << 63) else value
