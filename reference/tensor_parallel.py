"""Single-process truth for tensor parallelism: a dense Linear and a dense two-layer MLP, forward and
backward by plain autograd, the shards each rank keeps, and how far a parallel result may sit from
the dense one.

Megatron-LM (Shoeybi et al. 2019, section 3). A Linear y = x W^T + b with W of shape [out, in]:

* column parallel: rank r keeps rows r of W split in n contiguous chunks of out/n (and the same
  chunk of b) and computes y_r = x W_r^T + b_r, its slice of y's last dim; the gradient of x is
  the sum over ranks of g_r W_r (an all-reduce);
* row parallel: rank r keeps columns r of W (chunks of in/n) and its slice x_r of x's last dim,
  computes the partial x_r W_r^T; y = sum_r x_r W_r^T + b (an all-reduce; b added once, after it),
  and the gradient of x_r is g W_r, this rank's slice of g W.

The MLP y = GELU(x W1^T + b1) W2^T + b2 is column then row: the only communication is f (identity
forward, all-reduce backward) before the column layer and g (all-reduce forward, identity
backward) after the row layer. Sequence parallelism (Korthikanti et al. 2022, section 4.2.2)
shards x and y along the sequence dimension (dim -2) and turns f into an all-gather (backward:
reduce-scatter) and g into a reduce-scatter (backward: all-gather); the dense results are the same.

Every function computes in float64 from the values it is given and returns results cast back to
their dtype. Never imports torch.distributed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from parallelism_conformance.reference.tolerance import unit_roundoff

# The constant C of the tolerance (see ``linear_atol``): covers the reference's own rounding (for
# float64 inputs), second-order terms and the evaluation error of GELU and its derivative.
ATOL_FACTOR = 4.0
# max |GELU'(z)| = GELU'(sqrt 2) = 1.1289 and max |GELU''(z)| = GELU''(0) = 2 phi(0) = 0.7979 for the
# exact GELU z Phi(z), rounded up.
GELU_SLOPE = 1.13
GELU_CURVATURE = 0.8

SEQUENCE_DIM = -2


# ------------------------------------------------------------------------------------------ shards
def check_divisible(dimension: str, size: int, n: int) -> None:
    """The ValueError tensor parallelism raises when ``dimension`` of ``size`` does not split into
    ``n`` equal chunks (the message names all three)."""
    if n < 1:
        raise ValueError(f"the group size must be at least 1, got {n}")
    if size % n:
        raise ValueError(f"{dimension} = {size} is not divisible by the group size {n} ({size} % {n} = {size % n})")


def chunk(t: Tensor, dim: int, n: int, index: int, dimension: str = "dimension") -> Tensor:
    """Chunk ``index`` of ``n`` equal contiguous chunks of ``t`` along ``dim`` (a copy)."""
    size = t.shape[dim]
    check_divisible(dimension, size, n)
    each = size // n
    return t.narrow(dim, index * each, each).clone()


def column_shard(weight: Tensor, bias: Tensor | None, n: int, index: int) -> tuple[Tensor, Tensor | None]:
    """Rank ``index``'s part of a column-parallel Linear: rows of W [out, in] (out_features split
    in n contiguous chunks) and the same chunk of b."""
    w = chunk(weight, 0, n, index, "out_features")
    return w, None if bias is None else chunk(bias, 0, n, index, "out_features")


def row_shard(weight: Tensor, bias: Tensor | None, n: int, index: int) -> tuple[Tensor, Tensor | None]:
    """Rank ``index``'s part of a row-parallel Linear: columns of W [out, in] (in_features split
    in n contiguous chunks); the bias is kept whole on every rank."""
    w = chunk(weight, 1, n, index, "in_features")
    return w, None if bias is None else bias.clone()


def features_shard(t: Tensor, n: int, index: int) -> Tensor:
    """Rank ``index``'s slice of the last (feature) dimension."""
    return chunk(t, -1, n, index, "features")


def sequence_shard(t: Tensor, n: int, index: int) -> Tensor:
    """Rank ``index``'s slice of the sequence dimension (dim -2 of [..., seq, hidden]). Raises a
    ValueError naming the sequence length and n when they do not divide: sequence-parallel ranks
    hold equal shards."""
    if t.dim() < 2:
        raise ValueError(f"sequence parallelism needs inputs of shape [..., sequence, hidden], got {tuple(t.shape)}")
    return chunk(t, SEQUENCE_DIM, n, index, "sequence length")


# ---------------------------------------------------------------------------------- dense truth
def _autograd(forward, x: Tensor, params: dict[str, Tensor | None], grad_output: Tensor) -> dict[str, Tensor]:
    dtype = x.dtype
    x64 = x.detach().to(torch.float64).requires_grad_(True)
    p64 = {k: None if v is None else v.detach().to(torch.float64).requires_grad_(True) for k, v in params.items()}
    y = forward(x64, p64)
    y.backward(grad_output.detach().to(torch.float64))
    result = {"output": y.detach(), "grad_input": x64.grad}
    result.update({f"grad_{k}": v.grad for k, v in p64.items() if v is not None})
    return {k: v.to(dtype) for k, v in result.items()}


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, grad_output: Tensor) -> dict[str, Tensor]:
    """y = x W^T + b and, for the upstream gradient g = dL/dy, dL/dx = g W, dL/dW = g^T x (over
    all leading dims), dL/db = sum of g over all leading dims. Keys: output, grad_input,
    grad_weight, grad_bias (absent without bias)."""
    return _autograd(lambda x, p: F.linear(x, p["weight"], p["bias"]), x, {"weight": weight, "bias": bias}, grad_output)


def mlp(x: Tensor, fc1: tuple[Tensor, Tensor | None], fc2: tuple[Tensor, Tensor | None], grad_output: Tensor) -> dict[str, Tensor]:
    """y = GELU(x W1^T + b1) W2^T + b2 (exact GELU, z Phi(z)) and its gradients. Keys: output,
    grad_input, grad_fc1_weight, grad_fc1_bias, grad_fc2_weight, grad_fc2_bias (biases if any)."""

    def forward(x, p):
        return F.linear(F.gelu(F.linear(x, p["fc1_weight"], p["fc1_bias"])), p["fc2_weight"], p["fc2_bias"])

    params = {"fc1_weight": fc1[0], "fc1_bias": fc1[1], "fc2_weight": fc2[0], "fc2_bias": fc2[1]}
    return _autograd(forward, x, params, grad_output)


def normed_mlp(
    x: Tensor, norm: tuple[Tensor, Tensor, float], fc1: tuple[Tensor, Tensor | None], fc2: tuple[Tensor, Tensor | None], grad_output: Tensor
) -> dict[str, Tensor]:
    """The pre-norm block y = MLP(LayerNorm(x)): LayerNorm(x) = (x - mean) / sqrt(var + eps) * w + b
    over the last dim (biased variance, as torch's), then ``mlp``. Keys: those of ``mlp`` and
    grad_norm_weight, grad_norm_bias."""
    (w, b, eps), h = norm, x.shape[-1]

    def forward(x, p):
        normed = F.layer_norm(x, (h,), p["norm_weight"], p["norm_bias"], eps)
        return F.linear(F.gelu(F.linear(normed, p["fc1_weight"], p["fc1_bias"])), p["fc2_weight"], p["fc2_bias"])

    params = {"norm_weight": w, "norm_bias": b, "fc1_weight": fc1[0], "fc1_bias": fc1[1], "fc2_weight": fc2[0], "fc2_bias": fc2[1]}
    return _autograd(forward, x, params, grad_output)


def dropout_masks(x_shape: tuple[int, ...], ffn: int, p: float, seed: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The two masks of the contract's ``TensorParallelMLP(..., dropout=p)``, drawn as torch's CPU
    dropout draws one (F.dropout(t, p): noise = empty_like(t).bernoulli_(1 - p).div_(1 - p), then
    t * noise) from a generator seeded with ``seed``: first over the dense hidden activations
    [..., ffn], then over the dense output [..., h] (x's shape). A rank keeps its columns of the
    first (the sharded region) and the whole second, or its sequence shard of it under sequence
    parallelism (the replicated region), so tensor parallelism equals the dense block bitwise
    in its masks."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.empty((*x_shape[:-1], ffn), dtype=dtype).bernoulli_(1 - p, generator=generator).div_(1 - p)
    output = torch.empty(x_shape, dtype=dtype).bernoulli_(1 - p, generator=generator).div_(1 - p)
    return hidden, output


def dropout_mlp(
    x: Tensor, fc1: tuple[Tensor, Tensor | None], fc2: tuple[Tensor, Tensor | None], grad_output: Tensor, masks: tuple[Tensor, Tensor]
) -> dict[str, Tensor]:
    """y = m2 * (m1 * GELU(x W1^T + b1)) W2^T + b2), the masks of ``dropout_masks``, and its
    gradients (the keys of ``mlp``)."""
    m1, m2 = (m.to(torch.float64) for m in masks)

    def forward(x, p):
        hidden = F.gelu(F.linear(x, p["fc1_weight"], p["fc1_bias"])) * m1
        return F.linear(hidden, p["fc2_weight"], p["fc2_bias"]) * m2

    params = {"fc1_weight": fc1[0], "fc1_bias": fc1[1], "fc2_weight": fc2[0], "fc2_bias": fc2[1]}
    return _autograd(forward, x, params, grad_output)


def dropout_mlp_atol(
    x: Tensor, fc1: tuple[Tensor, Tensor | None], fc2: tuple[Tensor, Tensor | None], grad_output: Tensor, n: int, p: float
) -> dict[str, Tensor]:
    """``mlp_atol`` times s^2, s = 1 / (1 - p) the largest mask value: every quantity passes
    through at most the two masks, each scaling its terms by 0 or s, so the bound with every mask
    entry at s covers it."""
    scale = (1.0 / (1.0 - p)) ** 2
    return {key: bound * scale for key, bound in mlp_atol(x, fc1, fc2, grad_output, n).items()}


# ------------------------------------------------------------------------------------ tolerance
def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _tiny(result: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    return {k: ATOL_FACTOR * v + torch.finfo(dtype).tiny for k, v in result.items()}


def linear_atol(x: Tensor, weight: Tensor, bias: Tensor | None, grad_output: Tensor, n: int) -> dict[str, Tensor]:
    """Per-element absolute tolerance (float64) for each result of ``linear``, same keys.

    A parallel Linear computes each dot product of length K as n partial sums, then reduces them
    (in any order); Higham (2nd ed., section 3.1 and 4.2) bounds the error of any such summation
    order by gamma_{K+n} times the same sum of absolute values, gamma_k ~= k u. Hence, with u the
    dtype's unit roundoff, M the number of rows (product of the leading dims), C = ATOL_FACTOR:

        output:      C (in  + n + 2) u (|x| |W|^T + |b|)
        grad_input:  C (out + n + 2) u (|g| |W|)
        grad_weight: C (M   + n + 2) u (|g|^T |x|)
        grad_bias:   C (M   + n + 2) u sum_rows |g|

    plus finfo.tiny (a floor at zero). The + 2 counts the bias addition and the final cast.
    """
    u = unit_roundoff(x.dtype)
    x64, w, g = (t.detach().to(torch.float64).abs() for t in (x, weight, grad_output))
    out_f, in_f = weight.shape
    rows = _rows(x64).shape[0]
    b = torch.zeros(out_f, dtype=torch.float64) if bias is None else bias.detach().to(torch.float64).abs()
    result = {
        "output": (in_f + n + 2) * u * (x64 @ w.T + b),
        "grad_input": (out_f + n + 2) * u * (g @ w),
        "grad_weight": (rows + n + 2) * u * (_rows(g).T @ _rows(x64)),
    }
    if bias is not None:
        result["grad_bias"] = (rows + n + 2) * u * _rows(g).sum(0)
    return _tiny(result, x.dtype)


def mlp_atol(x: Tensor, fc1: tuple[Tensor, Tensor | None], fc2: tuple[Tensor, Tensor | None], grad_output: Tensor, n: int) -> dict[str, Tensor]:
    """``_mlp_error`` times C = ATOL_FACTOR, plus finfo.tiny: see there."""
    return _tiny(_mlp_error(x, fc1, fc2, grad_output, n), x.dtype)


def _mlp_error(
    x: Tensor, fc1: tuple[Tensor, Tensor | None], fc2: tuple[Tensor, Tensor | None], grad_output: Tensor, n: int, x_error: Tensor | None = None
) -> dict[str, Tensor]:
    """Per-element absolute tolerance (float64) for each result of ``mlp``, same keys: a first-order
    running error bound (Higham, 2nd ed., section 3.3) carried through the layers, in float64.

    With gamma(K) = (K + n + 2) u, z = x W1^T + b1, a = GELU(z), g = dL/dy, and G1 = GELU_SLOPE,
    G2 = GELU_CURVATURE bounding |GELU'| and |GELU''|:

        E_z  = gamma(h) (|x| |W1|^T + |b1|)
        E_a  = G1 E_z + 4 u (|z| + |a|)                     (GELU evaluated to a few ulps)
        E_y  = gamma(f) (|a| |W2|^T + |b2|) + E_a |W2|^T
        ga   = g W2,            E_ga = gamma(h) |g| |W2|
        gz   = ga GELU'(z),     E_gz = G1 E_ga + G2 |ga| E_z + 4 u |ga| (Phi(z) + |z| phi(z))
        dL/dx:  gamma(f) |gz| |W1| + E_gz |W1|
        dL/dW2: gamma(M) |g|^T |a| + |g|^T E_a        dL/db2: gamma(M) sum_rows |g|
        dL/dW1: gamma(M) |gz|^T |x| + E_gz^T |x|       dL/db1: gamma(M) sum_rows |gz| + sum_rows E_gz

    h = hidden (in) width, f = ffn width, M = rows. ``x_error`` E_x, when the input itself was
    computed with that error (the pre-norm block's LayerNorm): E_z gains E_x |W1|^T and dL/dW1 gains
    |gz|^T E_x; everything downstream carries it. ``x`` is then the exact input.
    """
    dtype = x.dtype
    u = unit_roundoff(dtype)
    f64 = [None if t is None else t.detach().to(torch.float64) for t in (x, fc1[0], fc1[1], fc2[0], fc2[1], grad_output)]
    x64, w1, b1, w2, b2, g = f64
    x64, g = _rows(x64), _rows(g)
    f_width, h = w1.shape
    rows = x64.shape[0]

    def gamma(k):
        return (k + n + 2) * u

    b1a = torch.zeros(f_width, dtype=torch.float64) if b1 is None else b1.abs()
    b2a = torch.zeros(w2.shape[0], dtype=torch.float64) if b2 is None else b2.abs()
    z = x64 @ w1.T + (0 if b1 is None else b1)
    a = F.gelu(z)
    phi = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    big_phi = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
    ga = g @ w2
    gz = ga * (big_phi + z * phi)

    e_x = torch.zeros_like(x64) if x_error is None else _rows(x_error.to(torch.float64))
    e_z = gamma(h) * (x64.abs() @ w1.abs().T + b1a) + e_x @ w1.abs().T
    e_a = GELU_SLOPE * e_z + 4 * u * (z.abs() + a.abs())
    e_y = gamma(f_width) * (a.abs() @ w2.abs().T + b2a) + e_a @ w2.abs().T
    e_ga = gamma(h) * (g.abs() @ w2.abs())
    e_gz = GELU_SLOPE * e_ga + GELU_CURVATURE * ga.abs() * e_z + 4 * u * ga.abs() * (big_phi + z.abs() * phi)
    shape = x.shape
    result = {
        "output": e_y.reshape(*shape[:-1], w2.shape[0]),
        "grad_input": (gamma(f_width) * (gz.abs() @ w1.abs()) + e_gz @ w1.abs()).reshape(shape),
        "grad_fc1_weight": gamma(rows) * (gz.abs().T @ x64.abs()) + e_gz.T @ x64.abs() + gz.abs().T @ e_x,
        "grad_fc2_weight": gamma(rows) * (g.abs().T @ a.abs()) + g.abs().T @ e_a,
    }
    if b1 is not None:
        result["grad_fc1_bias"] = gamma(rows) * gz.abs().sum(0) + e_gz.sum(0)
    if b2 is not None:
        result["grad_fc2_bias"] = gamma(rows) * g.abs().sum(0)
    return result


def normed_mlp_atol(
    x: Tensor,
    norm: tuple[Tensor, Tensor, float],
    fc1: tuple[Tensor, Tensor | None],
    fc2: tuple[Tensor, Tensor | None],
    grad_output: Tensor,
    n: int,
) -> dict[str, Tensor]:
    """Per-element tolerance of each result of ``normed_mlp``, same keys: the first-order running
    error bound of ``mlp_atol`` carried through the LayerNorm in front, per row of h elements (u the
    unit roundoff, gam(k) = (k + 2) u, r = 1 / sqrt(var + eps), x̂ = (x - mean) r):

        E_mean = gam(h) mean|x|              E_d = E_mean + u (|x| + |mean|)
        E_var  = gam(h) mean(d^2) + 2 mean(|d| E_d)
        E_r    = r (E_var / (2 (var + eps)) + 2 u)
        E_x̂    = E_d r + |d| E_r + u |x̂|     E_y = E_x̂ |w| + 2 u (|x̂| |w| + |b|)

    E_y is the MLP's input error (``_mlp_error``'s ``x_error``), which gives the bound E_gy of the
    MLP's input gradient gy. Then, with gamma(K) = (K + n + 2) u (the sums over rows span the
    ranks' shards), ĝ = gy w, A = |ĝ| + mean|ĝ| + |x̂| mean(|ĝ| |x̂|):

        dL/db (norm):  gamma(M) sum_rows |gy| + sum_rows E_gy
        dL/dw (norm):  gamma(M + 1) sum_rows |gy| |x̂| + sum_rows (E_gy |x̂| + |gy| E_x̂)
        dL/dx = r (ĝ - mean ĝ - x̂ mean(ĝ x̂)):
            r (E_ĝ + mean E_ĝ + |x̂| mean(E_ĝ |x̂| + |ĝ| E_x̂) + E_x̂ mean(|ĝ| |x̂|) + gam(h + 3) A) + E_r A

    with E_ĝ = E_gy |w| + u |gy| |w|; each times C = ATOL_FACTOR, plus finfo.tiny."""
    dtype, u = x.dtype, unit_roundoff(x.dtype)
    (w, b, eps), h = norm, x.shape[-1]
    x64 = _rows(x.detach().to(torch.float64))
    w64, b64 = w.detach().to(torch.float64), b.detach().to(torch.float64)
    mean = x64.mean(-1, keepdim=True)
    d = x64 - mean
    var = (d * d).mean(-1, keepdim=True)
    r = 1 / torch.sqrt(var + eps)
    xhat = d * r
    y = xhat * w64 + b64

    def gam(k):
        return (k + 2) * u

    e_d = gam(h) * x64.abs().mean(-1, keepdim=True) + u * (x64.abs() + mean.abs())
    e_var = gam(h) * var + 2 * (d.abs() * e_d).mean(-1, keepdim=True)
    e_r = r * (e_var / (2 * (var + eps)) + 2 * u)
    e_xhat = e_d * r + d.abs() * e_r + u * xhat.abs()
    e_y = e_xhat * w64.abs() + 2 * u * (xhat.abs() * w64.abs() + b64.abs())

    g = _rows(grad_output.detach().to(torch.float64))
    after = _mlp_error(y.to(dtype) if dtype != torch.float64 else y, fc1, fc2, g, n, x_error=e_y)
    fc1_64 = [None if t is None else t.detach().to(torch.float64) for t in fc1]
    fc2_64 = [None if t is None else t.detach().to(torch.float64) for t in fc2]
    z = y @ fc1_64[0].T + (0 if fc1_64[1] is None else fc1_64[1])
    ga = g @ fc2_64[0]
    gz = ga * (0.5 * (1 + torch.erf(z / math.sqrt(2))) + z * torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi))
    gy = gz @ fc1_64[0]
    e_gy = _rows(after.pop("grad_input"))
    rows = x64.shape[0]

    def gamma(k):
        return (k + n + 2) * u

    ghat = gy * w64
    e_ghat = e_gy * w64.abs() + u * gy.abs() * w64.abs()
    big = ghat.abs() + ghat.abs().mean(-1, keepdim=True) + xhat.abs() * (ghat.abs() * xhat.abs()).mean(-1, keepdim=True)
    e_bracket = (
        e_ghat
        + e_ghat.mean(-1, keepdim=True)
        + xhat.abs() * (e_ghat * xhat.abs() + ghat.abs() * e_xhat).mean(-1, keepdim=True)
        + e_xhat * (ghat.abs() * xhat.abs()).mean(-1, keepdim=True)
        + gam(h + 3) * big
    )
    result = {
        **after,
        "grad_input": (r * e_bracket + e_r * big).reshape(x.shape),
        "grad_norm_bias": gamma(rows) * gy.abs().sum(0) + e_gy.sum(0),
        "grad_norm_weight": gamma(rows + 1) * (gy.abs() * xhat.abs()).sum(0) + (e_gy * xhat.abs() + gy.abs() * e_xhat).sum(0),
    }
    result["output"] = result["output"].reshape(*x.shape[:-1], -1)
    return _tiny(result, dtype)
