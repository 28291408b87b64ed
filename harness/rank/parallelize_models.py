"""The models a parallelize function may declare (``function.model``), built alike on the ranks and,
for the dense twin, in the driver: the same spec and seed give the same state dict, bitwise. Each
takes token ids [rows, seq] and returns logits [rows, seq, vocab].

* "decoder" (the default): harness/rank/decoder_lm.py, the suite's own, float64, pure torch;
* "torchtitan_llama3": harness/rank/torchtitan_llama.py, torchtitan's own Llama at a debug size,
  float32 (torchtitan's ``training.mixed_precision_param`` takes "bfloat16" or "float32" only, and
  ``apply_fsdp_to_decoder`` casts the parameters to it: a float64 model would run in float32);
  needs torchtitan importable, in the ranks and in the driver."""

from __future__ import annotations

from parallelism_conformance.harness.rank import decoder_lm, torchtitan_llama

DTYPES = {"decoder": "float64", torchtitan_llama.MODEL: "float32"}
MODELS = tuple(DTYPES)


def build(kind: str, spec: dict, seed: int):
    if kind == "decoder":
        return decoder_lm.build(spec, seed)
    if kind == torchtitan_llama.MODEL:
        return torchtitan_llama.build(spec, seed)
    raise ValueError(f"unknown model {kind!r}: one of {MODELS}")
