"""What the MXFP4 families share about their weight's two layouts (as quantised, or packed by
``gemmtune.quant.prepack_mxfp4``): the ``packed`` key column, a torch backend per layout, which
layout the table's rows favour for a weight, and the other layout of a model shape's key."""

from __future__ import annotations

from typing import Callable, NamedTuple

from gemmtune.dispatch import KernelRegistry, table_index
from gemmtune.families._gemm import gemm_registry
from gemmtune.kernels import mxfp4
from gemmtune.kernels.problem import GemmProblem
from gemmtune.tables.schema import Column, Kind, Schema
from gemmtune.tables.store import Row

# A key's weight layout: False as quantised, True packed (one layout per (N, K) is what a model
# stores). Tables written before a family took packed weights have no such column: as quantised.
PACKED_COLUMN = Column("packed", Kind.BOOL, default="False")


class TorchBackends(NamedTuple):
    """A family's torch backend under its two names: for weights as quantised, and for packed
    ones (unpacked first, ``mxfp4.unpack``)."""
    unpacked: str
    packed: str

    def of(self, packed: bool) -> str:
        return self.packed if packed else self.unpacked


class _LayoutTorchBackend:
    """``run`` (a torch backend of MXFP4 weights as quantised) for one layout of the weight, a
    packed weight unpacked first; it runs only problems of its layout."""

    def __init__(self, run: Callable, names: TorchBackends, packed: bool):
        self.run = run
        self.names = names
        self.packed = packed

    def __call__(self, x, wq, bias, out_dtype, scale_a, scale_b, out=None):
        return self.run(x, mxfp4.unpack(wq) if self.packed else wq, bias, out_dtype, scale_a,
                        scale_b, out)

    def check(self, problem: GemmProblem) -> str | None:
        if problem.preshuffled == self.packed:
            return None
        return (f"{self.names.of(self.packed)} takes {'packed' if self.packed else 'unpacked'} "
                f"weights; use {self.names.of(problem.preshuffled)}")


def mxfp4_registry(family: str, names: TorchBackends, run: Callable,
                   triton_prefixes: tuple[str, ...]) -> KernelRegistry:
    """An MXFP4 family's backends: ``run`` under both torch names (each for its layout), and the
    Triton kernels of ``triton_prefixes`` (each config names the layout it reads)."""
    registry = gemm_registry(family, names.unpacked, _LayoutTorchBackend(run, names, False),
                             triton_prefixes)
    registry.register_exact(names.packed, _LayoutTorchBackend(run, names, True))
    return registry


def packed_layout_tuned(schema: Schema, names: TorchBackends, n: int, k: int,
                        same_weight: Callable[[tuple], bool] = lambda key: True) -> bool:
    """Whether an (N, K) weight is best stored packed, by ``schema``'s rows for this GPU (its
    own model's, else a similar one's, as dispatch finds them) whose keys pass ``same_weight``
    (e.g. x's dtype): there are rows for it packed, their kernels read packed weights themselves
    (none is the unpacking torch backend), and over the M that timed rows of both layouts have,
    the packed ones take no longer in all (one layout serves every M of a weight). Both rows of
    an M come from one GPU model where any model has both: this GPU's own, else another's
    (``TableIndex.rows_by_model``'s order), since a faster card's row of one layout beside a
    slower card's of the other compares the cards, not the layouts. Only where no model has
    both layouts at any M are the rows dispatch would take compared as they are; where no M has
    timed rows of both, the layout whose rows cover more M (``_covers_more_m``)."""
    if mxfp4.why_not_packable(k) is not None:
        return False
    index = table_index(schema)

    def of_weight(row) -> bool:
        return row.key.N == n and row.key.K == k and same_weight(row.key)

    rows = [row for row in index.rows() if of_weight(row)]
    packed = [row for row in rows if row.key.packed]
    if not packed or any(names.packed in row.kernel_names(schema) for row in packed):
        return False
    timed: dict[int, tuple[float, float]] = {}
    for model_rows in index.rows_by_model():
        for m, pair in _timed_pairs([row for row in model_rows if of_weight(row)]).items():
            timed.setdefault(m, pair)
    if not timed:
        timed = _timed_pairs(rows)
    if not timed:
        return _covers_more_m(packed, [row for row in rows if not row.key.packed])
    return sum(p for p, _ in timed.values()) <= sum(q for _, q in timed.values())


def _covers_more_m(packed: list[Row], plain: list[Row]) -> bool:
    """With no M timed in both layouts: whether the packed rows cover at least as many M as
    those as quantised. A weight with rows of one layout alone takes that layout: stored the
    other way, every call would miss its rows and run the family's default kernel."""
    return len({row.key.M for row in packed}) >= len({row.key.M for row in plain})


def _timed_pairs(rows: list[Row]) -> dict[int, tuple[float, float]]:
    """(packed µs, as quantised µs) of each M where ``rows`` have a timed row of both layouts."""
    packed = {row.key.M: _timed(row) for row in rows if row.key.packed}
    plain = {row.key.M: _timed(row) for row in rows if not row.key.packed}
    return {m: (packed[m], plain[m]) for m in packed.keys() & plain.keys()
            if packed[m] is not None and plain[m] is not None}


def _timed(row) -> float | None:
    """A row's µs, or None where it has none (a row written by hand)."""
    try:
        return row.us
    except (KeyError, TypeError, ValueError):
        return None


def packed_twin(key) -> tuple:
    """The same GEMM with the weight packed (``quant.prepack_mxfp4``), where K takes it: the
    other layout model shapes list (``Family.other_layouts``)."""
    if key.packed or mxfp4.why_not_packable(key.K) is not None:
        return ()
    return (key._replace(packed=True),)
