"""Named variants of a strategy in a comparison: the same strategy with other options, side by side.

    python recipes/compare.py compare.strategies=[zero3,zero3_int8,native_fsdp] \
        '+compare.variants={zero3_int8: {of: zero3, param_wire: int8, grad_wire: int8}}'

A variant runs as one more strategy: `of` says which (its spec, its YAML's defaults), the rest
overrides its options. Its reference is its `of` when that runs too (the uncompressed twin),
else the reference `of` would have.

A run that sends a compressed wire (grad_wire, param_wire or outer_wire set) cannot end with its
reference's parameters: every step rounds what travels. It is checked by the loss instead:
its final training loss within compare.loss_tolerance (relative) of its reference's.
"""

from __future__ import annotations

WIRE_OPTIONS = ("grad_wire", "param_wire", "outer_wire")


def base_of(name: str, variants) -> str:
    """The registered strategy `name` runs: itself, or a variant's `of`."""
    return str(variants[name]["of"]) if name in variants else name


def variant_options(name: str, variants) -> dict:
    """A variant's own options (its `of` removed); {} for a plain strategy."""
    return {k: v for k, v in dict(variants.get(name, {})).items() if k != "of"}


def compressed(options) -> bool:
    """Does a run with these strategy options round what it sends (a wire format set)?"""
    return any(options.get(k) is not None for k in WIRE_OPTIONS)
