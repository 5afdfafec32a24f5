"""The op families, one module or folder each, and their registry.

A family (``Family``) holds its table schema and key, its op's dispatcher, its tuner, how the
bench runs it and its Triton JSON tags. The CLI, the bench, capture and dispatch find families
here by name; ``register_family`` adds one. Each built-in family is one line below.
"""

from gemmtune.families._family import BenchOp, Comparison, Family
from gemmtune.families._registry import (all_families, get_family, register_family,
                                         unregister_family)
from gemmtune.families import (a4w4_blockscale, a8w8, a8w8_blockscale, a8w8_bpreshuffle,
                               a16w4, batched_a8w8, batched_bf16, bf16, fmoe)

register_family(bf16.FAMILY)
register_family(a8w8.FAMILY)
register_family(a8w8_blockscale.FAMILY)
register_family(a8w8_bpreshuffle.FAMILY)
register_family(a4w4_blockscale.FAMILY)
register_family(a16w4.FAMILY)
register_family(batched_bf16.FAMILY)
register_family(batched_a8w8.FAMILY)
register_family(fmoe.FAMILY)

__all__ = ["BenchOp", "Comparison", "Family", "all_families", "get_family", "register_family",
           "unregister_family"]
