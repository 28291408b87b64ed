"""torchtitan's own Llama (``Llama3Model``, torchtitan 0.3.0) at a debug size, for ``--parallelize``
with a function that declares ``model = "torchtitan_llama3"`` (torchtitan's ``parallelize_llama``
calls the model's own ``parallelize(parallel_dims)``, which only torchtitan's modules have). Built
the way its flavors are (models/llama3/__init__.py, ``_debugmodel``: ``_build_llama3_layers`` with a
fused qkv, ComplexRoPE, ``set_llama3_sharding_config(enable_sp=True)`` as
``Llama3Model.Config.update_from_config`` does), smaller. Nothing here touches torch.distributed:
the driver builds the dense twin from the same spec and seed, bitwise (torchtitan must import there,
so the driver runs in torchtitan's venv: ``scripts/libraries --prepare torchtitan``).

One change from torchtitan's flavors, a model setting, not a job_config one: each block's inner
attention is torchtitan's ``ScaledDotProductAttention`` (causal), not FlexAttention, the default of
``get_attention_config``, which has no backward on CPU (torch 2.13: "FlexAttention does not support
backward on CPU"; tests/libraries/torchtitan_llama_parallelize_on_gloo.py shows it); 0.3.0's
``get_attention_config("sdpa")`` refuses language models, so the configs are swapped after
``_build_llama3_layers``, as that script does.

Spec: {"vocab", "heads", "kv_heads", "head_dim", "ffn", "layers", "dtype"}; dim = heads x head_dim
(torchtitan's head_dim is dim / n_heads), head_dim even (ComplexRoPE pairs it)."""

from __future__ import annotations

import torch

from parallelism_conformance.harness.rank.decoder_lm import draw_parameters

MODEL = "torchtitan_llama3"


def config(spec: dict):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers, _output_linear_init
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    dim, vocab = spec["heads"] * spec["head_dim"], spec["vocab"]
    layers = _build_llama3_layers(
        fuse_qkv=True,
        n_layers=spec["layers"],
        dim=dim,
        n_heads=spec["heads"],
        n_kv_heads=spec["kv_heads"],
        hidden_dim=spec["ffn"],
        rope=ComplexRoPE.Config(dim=spec["head_dim"], max_seq_len=64, theta=10000.0),
        attn_backend="flex",
    )
    for layer in layers:  # FlexAttention has no backward on CPU (the module docstring)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=layers,
    )
    set_llama3_sharding_config(cfg, enable_sp=True)
    return cfg


def build(spec: dict, seed: int):
    """The Llama of ``spec``: torchtitan builds it and runs its ``init_weights`` (the RoPE cache among
    its buffers) under a forked global RNG seeded with ``seed`` (the caller's RNG undisturbed), then
    every parameter is drawn again from ``seed`` in named order as harness/rank/decoder_lm.py's
    ``build`` draws them (unit-scale matrices, norm weights 1 + N(0, 1) / 4, the residual projections
    ``wo`` and ``w2`` scaled by 1 / (2 L)): torchtitan's own init (std 0.02) gives near-uniform
    logits and gradients so small that a missing reduction moves them less than a bound relative
    to 1 + |expected| could show."""
    if spec.get("dtype", "float32") != "float32":  # .to(dtype) would cast RoPE's complex cache to real: float32 only
        raise ValueError(f"torchtitan's Llama is built in float32 here, not {spec['dtype']}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = config(spec).build()
        with torch.no_grad():
            model.init_weights()
    draw_parameters(model, seed, spec["layers"])
    return model
