"""Finding the row for a call: exact M, padded M, coarse M, nearest tuned M, then the default.

Only rows of this device (``arch``, ``cu_num``) take part; a row without an ``arch`` (the seeds'
tables key on ``cu_num`` alone) matches any architecture with that SM count. Within each rule a
row of this GPU model (``gpu``) wins over a row of another model with that arch and SM count, or
of none named (tables written before the ``gpu`` column): the latter is a similar-gpu match.
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
    # The row is of another GPU model of this arch and SM count (or of no named model): logged
    # as a similar-gpu match.
    similar_gpu: bool = False


class _Rows:
    """Rows of one device tier indexed for the rules: by whole key, and by the key without M
    (for the nearest tuned M)."""

    def __init__(self, m_index: int):
        self._m = m_index
        self.exact: dict[tuple, Row] = {}
        self._by_rest: dict[tuple, dict[int, Row]] = {}
        self._sorted: dict[tuple, list[int]] = {}

    def add(self, row: Row) -> None:
        self.exact[row.key] = row
        self._by_rest.setdefault(self.rest(row.key), {})[row.key[self._m]] = row

    def done(self) -> None:
        self._sorted = {k: sorted(v) for k, v in self._by_rest.items()}

    def rest(self, key: tuple) -> tuple:
        return key[: self._m] + key[self._m + 1:]

    def nearest(self, key: tuple) -> Row | None:
        ms = self._sorted.get(self.rest(key))
        if not ms:
            return None
        return self._by_rest[self.rest(key)][_nearest(ms, key[self._m])]


class TableIndex:
    """Rows of one family on one device, indexed for the look-up order above. Each rule looks
    first at rows of the device's own GPU model, then at rows of another model (or none named)
    with the same arch and SM count."""

    def __init__(self, schema: Schema, rows: Iterable[Row], device: DeviceId):
        self.schema = schema
        self.device = device
        self._m = schema.m_index
        self._n = schema.key_names.index("N") if "N" in schema.key_names else None
        self._same, self._similar = _Rows(self._m), _Rows(self._m)
        self._held: list[Row] = []
        for row in rows:
            if row.cu_num != device.cu_num or (row.arch and row.arch != device.arch):
                continue
            self._held.append(row)
            tier = self._same if device.gpu and row.gpu == device.gpu else self._similar
            old = tier.exact.get(row.key)
            if old is None or _preferred(row, old):
                tier.add(row)
        self._same.done()
        self._similar.done()

    def __len__(self) -> int:
        return len(self._same.exact) + len(self._similar.exact.keys() - self._same.exact.keys())

    @property
    def same_gpu_rows(self) -> int:
        return len(self._same.exact)

    def rows_by_model(self) -> list[list[Row]]:
        """The rows of each GPU model held here, a list a model (each key once in it): this
        GPU's own first, then the others by name (rows of none named last). Where the look-up
        rules take a key's row from whichever similar model measured it fastest, these keep
        each card's rows apart, for comparing two of one card's measurements."""
        by_model: dict[str, dict[tuple, Row]] = {}
        for row in self._held:
            model = by_model.setdefault(row.gpu, {})
            old = model.get(row.key)
            if old is None or _preferred(row, old):
                model[row.key] = row
        own = self.device.gpu
        names = sorted(by_model, key=lambda gpu: (gpu != own or not own, not gpu, gpu))
        return [list(by_model[gpu].values()) for gpu in names]

    def rows(self) -> list[Row]:
        """The row a call with each key held here would find exactly: this GPU model's, else
        the similar GPU's."""
        similar = [row for key, row in self._similar.exact.items() if key not in self._same.exact]
        return list(self._same.exact.values()) + similar

    def _with_m(self, key: tuple, m: int) -> tuple:
        return key[: self._m] + (m,) + key[self._m + 1:]

    def find(self, key: tuple) -> Match:
        m = key[self._m]
        n = key[self._n] if self._n is not None else None
        for rule, candidate in ((Rule.exact, key), (Rule.padded, self._with_m(key, padded_m(m))),
                                (Rule.coarse, self._with_m(key, coarse_m(m, n)))):
            for tier in (self._same, self._similar):
                row = tier.exact.get(candidate)
                if row is not None:
                    return Match(rule, row, similar_gpu=tier is self._similar and
                                 row.gpu != self.device.gpu)
        for tier in (self._same, self._similar):
            row = tier.nearest(key)
            if row is not None:
                return Match(Rule.nearest, row, similar_gpu=tier is self._similar and
                             row.gpu != self.device.gpu)
        return Match(Rule.default, None)


def _preferred(row: Row, old: Row) -> bool:
    """Which of two rows of one shape in one tier serves it: one naming this arch beats an
    arch-less one (the seeds' tables key on cu_num alone); between rows of two other GPU models,
    the faster measurement, so the choice does not depend on the order of the files."""
    if bool(row.arch) != bool(old.arch):
        return bool(row.arch)
    return row.results.get("us", 0) < old.results.get("us", 0)


def _nearest(sorted_ms: list[int], m: int) -> int:
    """The tuned M closest to ``m``; on a tie, the larger one."""
    i = bisect.bisect_left(sorted_ms, m)
    if i == 0:
        return sorted_ms[0]
    if i == len(sorted_ms):
        return sorted_ms[-1]
    below, above = sorted_ms[i - 1], sorted_ms[i]
    return below if m - below < above - m else above
