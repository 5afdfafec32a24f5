"""Finding the row for a call: exact M, padded M, coarse M, nearest tuned M, then the default.

Only rows of this device (``arch``, ``cu_num``) take part; a row without an ``arch`` (the seeds'
tables key on ``cu_num`` alone) matches any architecture with that SM count.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable
from dataclasses import dataclass

from gemmtune.device import DeviceId
from gemmtune.tables.schema import Schema
from gemmtune.tables.store import Row


class Rule(str, enum.Enum):
    exact = "exact"
    padded = "padded"
    coarse = "coarse"
    nearest = "nearest"
    default = "default"
    forced = "forced"  # no look-up: the call named its kernel (``kernel=``)


def padded_m(m: int) -> int:
    """Fine padding: the next multiple of 16 up to 256, of 32 up to 1024, of 64 up to 4096, else 128."""
    step = 16 if m <= 256 else 32 if m <= 1024 else 64 if m <= 4096 else 128
    return -(-m // step) * step


def coarse_m(m: int, n: int | None) -> int:
    """Coarse padding: the next power of two; very large M with wide N shares the 8192 row, since
    such shapes are compute-bound and one large-tile kernel serves them all."""
    if m > 8192 and n is not None and n > 4096:
        return 8192
    return 1 << max(0, (m - 1).bit_length())


@dataclass(frozen=True)
class Match:
    rule: Rule
    row: Row | None


class TableIndex:
    """Rows of one family on one device, indexed for the look-up order above."""

    def __init__(self, schema: Schema, rows: Iterable[Row], device: DeviceId):
        self.schema = schema
        self.device = device
        self._m = schema.m_index
        self._n = schema.key_names.index("N") if "N" in schema.key_names else None
        self._exact: dict[tuple, Row] = {}
        by_rest: dict[tuple, dict[int, Row]] = {}
        for row in rows:
            if row.cu_num != device.cu_num or (row.arch and row.arch != device.arch):
                continue
            # A row naming this arch beats an arch-less row of the same shape.
            if row.key in self._exact and not row.arch:
                continue
            self._exact[row.key] = row
            by_rest.setdefault(self._rest(row.key), {})[row.key[self._m]] = row
        self._by_rest = {k: (sorted(v), v) for k, v in by_rest.items()}

    def __len__(self) -> int:
        return len(self._exact)

    def _rest(self, key: tuple) -> tuple:
        return key[: self._m] + key[self._m + 1:]

    def _with_m(self, key: tuple, m: int) -> tuple:
        return key[: self._m] + (m,) + key[self._m + 1:]

    def find(self, key: tuple) -> Match:
        row = self._exact.get(key)
        if row is not None:
            return Match(Rule.exact, row)
        m = key[self._m]
        row = self._exact.get(self._with_m(key, padded_m(m)))
        if row is not None:
            return Match(Rule.padded, row)
        n = key[self._n] if self._n is not None else None
        row = self._exact.get(self._with_m(key, coarse_m(m, n)))
        if row is not None:
            return Match(Rule.coarse, row)
        tuned = self._by_rest.get(self._rest(key))
        if tuned is not None:
            return Match(Rule.nearest, tuned[1][_nearest(tuned[0], m)])
        return Match(Rule.default, None)


def _nearest(sorted_ms: list[int], m: int) -> int:
    """The tuned M closest to ``m``; on a tie, the larger one."""
    i = bisect.bisect_left(sorted_ms, m)
    if i == 0:
        return sorted_ms[0]
    if i == len(sorted_ms):
        return sorted_ms[-1]
    below, above = sorted_ms[i - 1], sorted_ms[i]
    return below if m - below < above - m else above
