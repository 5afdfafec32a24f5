"""Plan once per shape, run many: the table look-up behind every op.

The first call with a new shape key resolves the row (exact → padded → coarse → nearest →
default), turns its ``kernelName`` into a callable, logs the decision if asked and records the
shape when capturing. Every later call with that key is one dict hit. A row whose kernel name no
longer parses, or whose backend is missing, falls back to the family default with one warning.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gemmtune import _env
from gemmtune.device import DeviceId, current_device
from gemmtune.kernels.problem import GemmProblem, Scaling
from gemmtune.tables.capture import record_shape
from gemmtune.tables.lookup import Rule, TableIndex
from gemmtune.tables.schema import Family, Schema, schema_for
from gemmtune.tables.sources import load_merged
from gemmtune.tables.store import Row
from gemmtune.tables.values import to_torch_dtype

log = logging.getLogger("gemmtune")


class KernelNameError(ValueError):
    """A ``kernelName`` that no registered backend can turn into a kernel."""


class KernelRegistry:
    """Backends of one family: a name prefix (the part before ``:``) and a parser that turns a
    whole name into a callable. The name is the whole truth about a solution (DESIGN: Core idea)."""

    def __init__(self, family: Family):
        self.family = family
        self._parsers: dict[str, Callable[[str], Callable]] = {}
        self._resolved: dict[str, Callable] = {}

    def register(self, prefix: str, parser: Callable[[str], Callable]) -> None:
        self._parsers[prefix] = parser

    def register_exact(self, name: str, kernel: Callable) -> None:
        """A backend with one kernel and no config, named ``name`` exactly (``torch.linear``)."""

        def parse(given: str) -> Callable:
            if given != name:
                raise ValueError(f"unknown kernel {given!r}; expected {name!r}")
            return kernel

        self.register(name.split(":", 1)[0], parse)

    @property
    def prefixes(self) -> tuple[str, ...]:
        return tuple(self._parsers)

    def resolve(self, name: str) -> Callable:
        kernel = self._resolved.get(name)
        if kernel is None:
            prefix = name.split(":", 1)[0]
            parser = self._parsers.get(prefix)
            if parser is None:
                raise KernelNameError(
                    f"{self.family.value}: no backend for kernelName {name!r}; known prefixes: "
                    f"{', '.join(self._parsers)}")
            try:
                kernel = parser(name)
            except (ValueError, ImportError, RuntimeError) as e:
                raise KernelNameError(f"{self.family.value}: kernelName {name!r}: {e}") from e
            self._resolved[name] = kernel
        return kernel


@dataclass(frozen=True)
class Decision:
    family: Family
    key: tuple  # canonical table key (shape columns, schema order)
    rule: Rule
    kernel_name: str
    row: Row | None
    note: str = ""

    def describe(self, schema: Schema) -> str:
        shape = " ".join(f"{n}={v}" for n, v in zip(schema.key_names, self.key))
        where = f" from {self.row.source}" if self.row is not None and self.row.source else ""
        note = f" ({self.note})" if self.note else ""
        return (f"{self.family.value} {shape}: rule={self.rule.value} "
                f"kernelName={self.kernel_name}{where}{note}")


@dataclass(frozen=True)
class Plan:
    decision: Decision
    run: Callable
    miss: bool  # counted on every call: the shape fell back from an exact row


# Shared by all dispatchers: one table index per family, the miss counts, and a lock so that two
# threads planning at once build each index once.
_indexes: dict[Family, TableIndex] = {}
_misses: Counter = Counter()
_decisions: dict[tuple[Family, tuple], Decision] = {}
_dispatchers: list["Dispatcher"] = []
_lock = threading.RLock()


def table_index(family: Family, device: DeviceId | None = None) -> TableIndex:
    device = device or current_device()
    with _lock:
        index = _indexes.get(family)
        if index is None or index.device != device:
            index = TableIndex(schema_for(family), load_merged(schema_for(family)), device)
            _indexes[family] = index
        return index


def why_not_run(run: Callable, family: Family, key: tuple) -> str | None:
    """Why a resolved kernel cannot run table ``key``, or None. cuBLASLt kernels check a plain
    ``GemmProblem``; the other kernels registered here still check the table key."""
    if not hasattr(run, "check"):
        return None
    from gemmtune.kernels.cublaslt import CublasLtKernel

    if not isinstance(run, CublasLtKernel):
        return run.check(key)
    try:
        problem = _gemm_problem(family, key)
    except ValueError as e:  # a dtype name the tables do not know
        return str(e)
    return run.check(problem)


def _gemm_problem(family: Family, key: tuple) -> GemmProblem:
    """The problem of a bf16 key (``M, N, K, bias, dtype, outdtype, scaleAB, bpreshuffle``) or
    an a8w8 key (``M, N, K, q_dtype_w``: bf16 output, no bias, scales per tensor or per row)."""
    if family is Family.a8w8:
        m, n, k, q_dtype = key
        return GemmProblem(m, n, k, to_torch_dtype(q_dtype), torch.bfloat16,
                           scaling=Scaling.rowwise)
    m, n, k, has_bias, dtype, out_dtype, scaled, preshuffled = key
    return GemmProblem(m, n, k, to_torch_dtype(dtype), to_torch_dtype(out_dtype), bool(has_bias),
                       Scaling.tensor if scaled else Scaling.none, bool(preshuffled))


class Dispatcher:
    """Plans for one family. ``to_table_key`` maps the op's raw hot-path key (plain values and
    torch dtypes) to the canonical table key; ``default_kernel`` names the always-valid fallback
    for a canonical key."""

    def __init__(self, family: Family, registry: KernelRegistry,
                 to_table_key: Callable[[tuple], tuple],
                 default_kernel: Callable[[tuple, DeviceId], str]):
        self.family = family
        self.schema = schema_for(family)
        self.registry = registry
        self.to_table_key = to_table_key
        self.default_kernel = default_kernel
        self.plans: dict[tuple, Plan] = {}
        with _lock:
            _dispatchers.append(self)

    def plan(self, raw_key: tuple, device_index: int | None = None) -> Plan:
        """The plan for ``raw_key`` on the device of a tensor with ``get_device() == device_index``
        (part of the raw key, so CPU and GPU tensors of one shape get their own plans)."""
        plan = self.plans.get(raw_key)
        if plan is None:
            plan = self._make_plan(raw_key, device_index)
        return plan

    def decide(self, key: tuple, device: DeviceId | None = None) -> Decision:
        """The row and rule that a call with canonical ``key`` would use, after checking that the
        row's kernel can run it (falling back to the default as a call would). No side effects
        besides loading the tables."""
        return self._decide_and_resolve(key, device or current_device())[0]

    def _decide_and_resolve(self, key: tuple, device: DeviceId) -> tuple[Decision, Callable]:
        match = table_index(self.family, device).find(key)
        if match.row is None:
            name = self.default_kernel(key, device)
            return Decision(self.family, key, Rule.default, name, None), self.registry.resolve(name)
        names = match.row.kernel_names(self.schema)
        decision = Decision(self.family, key, match.rule, names[0] if names else "", match.row)
        try:
            run = self.registry.resolve(decision.kernel_name)
            # A kernel may refuse a shape it cannot serve (a config too large for this dtype):
            # checked once here, so each call can skip its own checks.
            problem = why_not_run(run, self.family, key)
            if problem:
                raise KernelNameError(f"{self.family.value}: {decision.kernel_name} cannot run "
                                      f"this shape: {problem}")
        except KernelNameError as e:
            source = decision.row.source if decision.row is not None else None
            _warn_unusable_row(str(e), str(source) if source else "")
            fallback = self.default_kernel(key, device)
            decision = Decision(self.family, key, Rule.default, fallback, decision.row,
                                note=f"row kernel unusable: {decision.kernel_name}")
            run = self.registry.resolve(fallback)
        return decision, run

    def _make_plan(self, raw_key: tuple, device_index: int | None) -> Plan:
        # Read the switches first: a bad value raises here, before anything is cached, so every
        # call raises the same error rather than only the first.
        log_it, capture_it = _env.log_tuned_config(), _env.capture_enabled()
        key = self.to_table_key(raw_key)
        decision, run = self._decide_and_resolve(key, current_device(device_index))
        plan = Plan(decision, run, miss=decision.rule is not Rule.exact)
        if log_it:
            _ensure_log_handler()
            log.info("gemmtune: %s", decision.describe(self.schema))
        if capture_it:
            try:
                record_shape(self.schema, key)
            except OSError as e:
                _warn_capture_failed(str(e))
        with _lock:
            self.plans[raw_key] = plan
            _decisions[(self.family, key)] = decision
        return plan


def count_miss(plan: Plan) -> None:
    _misses[(plan.decision.family, plan.decision.key)] += 1


@functools.cache
def _warn_unusable_row(message: str, source: str) -> None:
    where = f" (row {source})" if source else ""
    warnings.warn(f"{message}{where}; using the family default instead. Retune this shape or "
                  f"remove the row.", stacklevel=2)


@functools.cache
def _warn_capture_failed(message: str) -> None:
    warnings.warn(f"gemmtune: shape capture could not write its shard ({message}); shapes are "
                  f"not being recorded. Check GEMMTUNE_CAPTURE_DIR.", stacklevel=2)


@functools.cache
def _ensure_log_handler() -> None:
    # Users asking for decision logs should see them without configuring logging themselves.
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)


@dataclass(frozen=True)
class Miss:
    family: Family
    shape: dict
    rule: Rule
    kernel_name: str
    calls: int


def report_misses() -> list[Miss]:
    """Shapes that were not found exactly in a table, how often each was called, and the rule that
    served them instead, most frequent first."""
    with _lock:
        items = list(_misses.items())
    report = []
    for (family, key), calls in sorted(items, key=lambda kv: -kv[1]):
        decision = _decisions[(family, key)]
        names = schema_for(family).key_names
        report.append(Miss(family, dict(zip(names, key)), decision.rule, decision.kernel_name,
                           calls))
    return report


def format_misses(misses: list[Miss]) -> str:
    if not misses:
        return "no misses: every call found an exact table row"
    lines = [f"{'calls':>8}  {'family':<16} {'rule':<8} shape -> kernel"]
    for m in misses:
        shape = " ".join(f"{k}={v}" for k, v in m.shape.items())
        lines.append(f"{m.calls:>8}  {m.family.value:<16} {m.rule.value:<8} {shape} -> "
                     f"{m.kernel_name}")
    return "\n".join(lines)


def reset() -> None:
    """Forget loaded tables, plans and miss counts (after changing tables or variables)."""
    with _lock:
        _indexes.clear()
        _misses.clear()
        _decisions.clear()
        for d in _dispatchers:
            d.plans.clear()
    _warn_unusable_row.cache_clear()
    _warn_capture_failed.cache_clear()
