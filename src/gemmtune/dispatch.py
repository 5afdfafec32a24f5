"""Plan once per shape, run many: the table look-up behind every op.

The first call with a new shape key resolves the row (exact → padded → coarse → nearest →
default), turns its ``kernelName`` into a callable, checks once that the kernel can run the
family's plain problem for that key, logs the decision if asked and records the shape when
capturing. Every later call with that key is one dict hit. A row whose kernel name no longer
parses, whose backend is missing, or whose kernel refuses the shape falls back to the family
default with one warning. A call may also force a kernel by name (``kernel=``), checked the same
way; what it cannot run is an error.

An op's eager hot path goes one step further: ``Dispatcher.calls`` maps the op's own call key
(shapes, dtypes and devices of every tensor, the options) to the plan's kernel bound to that
key (``bound_call``), so that a cached call is one dict hit and the kernel's launch, with no
planning, no checks and no re-deriving of what the key fixes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from gemmtune import _env
from gemmtune.device import DeviceId, current_device
from gemmtune.tables.capture import record_shape
from gemmtune.tables.lookup import Rule, TableIndex
from gemmtune.tables.schema import Schema
from gemmtune.tables.sources import load_merged
from gemmtune.tables.store import Row
from gemmtune.tables.values import LibType

log = logging.getLogger("gemmtune")


class KernelNameError(ValueError):
    """A ``kernelName`` that no registered backend can turn into a kernel, or whose kernel
    cannot run the problem at hand; ``why`` is the kernel's own reason where it gave one (the
    same for every row of a backend whose library is missing)."""

    def __init__(self, message: str, why: str = ""):
        super().__init__(message)
        self.why = why or message


class KernelRegistry:
    """Backends of one family: a name prefix (the part before ``:``) and a parser that turns a
    whole name into a callable. The name is the whole truth about a solution (DESIGN: Core idea).
    A kernel may have ``check(problem) -> str | None``: why it cannot run the family's plain
    problem for a key (dispatch asks once per key); and ``bind(x, w, bias, out_dtype, scale_a,
    scale_b)``: its calls for arguments like these, or None (see ``bound_call``)."""

    def __init__(self, family: str):
        self.family = family
        self._parsers: dict[str, Callable[[str], Callable]] = {}
        self._resolved: dict[str, Callable] = {}
        self._binders: dict[str, Callable] = {}  # register_exact's kernels that bind

    def register(self, prefix: str, parser: Callable[[str], Callable]) -> None:
        LibType.of_kernel(prefix)  # a prefix names one of the backends (ValueError otherwise)
        self._parsers[prefix] = parser

    def register_exact(self, name: str, kernel: Callable, bind: Callable | None = None) -> None:
        """A backend with one kernel and no config, named ``name`` exactly (``torch.linear``);
        ``bind`` serves as the kernel's ``bind`` (a plain function has none)."""
        if bind is not None:
            self._binders[name] = bind

        def parse(given: str) -> Callable:
            if given != name:
                raise ValueError(f"unknown kernel {given!r}; expected {name!r}")
            return kernel

        self.register(name.split(":", 1)[0], parse)

    @property
    def prefixes(self) -> tuple[str, ...]:
        return tuple(self._parsers)

    @property
    def libtypes(self) -> frozenset[LibType]:
        """The backends this family has (its prefixes' ``libtype``)."""
        return frozenset(LibType.of_kernel(p) for p in self._parsers)

    def resolve(self, name: str) -> Callable:
        kernel = self._resolved.get(name)
        if kernel is None:
            prefix = name.split(":", 1)[0]
            parser = self._parsers.get(prefix)
            if parser is None:
                raise KernelNameError(
                    f"{self.family}: no backend for kernelName {name!r}; known prefixes: "
                    f"{', '.join(self._parsers)}")
            try:
                kernel = parser(name)
            except (ValueError, ImportError, RuntimeError) as e:
                raise KernelNameError(f"{self.family}: kernelName {name!r}: {e}") from e
            self._resolved[name] = kernel
        return kernel

    def bound_call(self, name: str, kernel: Callable, x, w, bias, out_dtype, scale_a,
                   scale_b) -> Callable:
        """``kernel`` (the one ``name`` resolves to) as ``run(x, w, bias[, scale_a, scale_b])``
        for calls whose tensors have the dtypes, shapes and devices of these arguments, with
        ``out_dtype`` fixed: what its own ``bind`` gives, else (no bind, or a bind that gives
        None) the plain call."""
        bind = self._binders.get(name) or getattr(kernel, "bind", None)
        bound = None if bind is None else bind(x, w, bias, out_dtype, scale_a, scale_b)
        if bound is not None:
            return bound

        def run(x, w, bias, scale_a=None, scale_b=None):
            return kernel(x, w, bias, out_dtype, scale_a, scale_b)

        return run

    def resolve_for(self, name: str, problem) -> Callable:
        """``resolve(name)``, checked against ``problem``: KernelNameError saying why not."""
        kernel = self.resolve(name)
        why = kernel.check(problem) if hasattr(kernel, "check") else None
        if why:
            raise KernelNameError(f"{self.family}: {name} cannot run this shape: {why}", why)
        return kernel

    def can_run(self, name: str, problem) -> bool:
        """Whether ``resolve_for(name, problem)`` succeeds: a name a backend knows that can run
        ``problem``."""
        try:
            self.resolve_for(name, problem)
        except KernelNameError:
            return False
        return True


@dataclass(frozen=True)
class Decision:
    family: str
    key: tuple  # the family's key NamedTuple (canonical values)
    rule: Rule
    kernel_name: str
    row: Row | None
    note: str = ""

    def describe(self, schema: Schema) -> str:
        where = f" from {self.row.source}" if self.row is not None and self.row.source else ""
        note = f" ({self.note})" if self.note else ""
        return (f"{self.family} {schema.describe_key(self.key)}: rule={self.rule.value} "
                f"kernelName={self.kernel_name}{where}{note}")


@dataclass(frozen=True)
class Plan:
    decision: Decision
    run: Callable
    # The shape fell back from an exact row: a one-element list counting its calls, shared by
    # every plan of the same table key (what report_misses tells); None for an exact or
    # forced row.
    miss_calls: list[int] | None
    generation: int = 0  # of the tables it was planned from (_forget_plans counts them)

    @property
    def miss(self) -> bool:
        return self.miss_calls is not None


# Shared by all dispatchers: one table index per family, table overrides, the miss counts, and a
# lock so that two threads planning at once build each index once.
_indexes: dict[str, TableIndex] = {}
_overrides: dict[str, tuple[Path, ...]] = {}
_misses: dict[tuple[str, tuple], list[int]] = {}  # (family, table key) -> [calls]
_decisions: dict[tuple[str, tuple], Decision] = {}
_dispatchers: dict[str, "Dispatcher"] = {}
_lock = threading.RLock()
# Bumped whenever plans are forgotten: a plan made from the tables before cannot be bound after.
_generation = 0


def table_index(schema: Schema, device: DeviceId | None = None) -> TableIndex:
    """The family's rows for ``device`` (default: the current one), loaded once."""
    device = device or current_device()
    with _lock:
        index = _indexes.get(schema.family)
        if index is None or index.device != device:
            paths = _overrides.get(schema.family)
            rows = load_merged(schema, None if paths is None else list(paths))
            index = TableIndex(schema, rows, device)
            _indexes[schema.family] = index
        return index


@contextlib.contextmanager
def use_tables(schema: Schema, paths: list[Path]) -> Iterator[None]:
    """Within the block, the family dispatches from ``paths`` alone (the shipped tables and the
    overlays set by variables are left out): ``--run_config`` benchmarks a table this way."""
    with _lock:
        previous = _overrides.get(schema.family)
        _overrides[schema.family] = tuple(paths)
        _forget_plans(schema.family)
    try:
        yield
    finally:
        with _lock:
            if previous is None:
                _overrides.pop(schema.family, None)
            else:
                _overrides[schema.family] = previous
            _forget_plans(schema.family)


class Dispatcher:
    """Plans for one family. ``to_table_key`` maps the op's raw hot-path key (plain values and
    torch dtypes) to the family's key; ``problem_of`` maps that key to the plain problem kernels
    check; ``default_kernel`` names the always-valid fallback for a key on a device;
    ``row_kernel`` makes one kernelName of a row's kernel columns."""

    def __init__(self, schema: Schema, registry: KernelRegistry,
                 to_table_key: Callable[[tuple], tuple], problem_of: Callable[[tuple], object],
                 default_kernel: Callable[[tuple, DeviceId], str],
                 row_kernel: Callable[[tuple[str, ...]], str] = lambda names: names[0]):
        self.family = schema.family
        self.schema = schema
        self.registry = registry
        self.to_table_key = to_table_key
        self.problem_of = problem_of
        self.default_kernel = default_kernel
        # The one kernelName a row's kernel columns make (fmoe: both stages, "stage1+stage2").
        self.row_kernel = row_kernel
        # raw key -> plan; (raw key, kernel name) -> plan for calls that force a kernel
        self.plans: dict[tuple, Plan] = {}
        # an op's call key -> its plan's kernel bound to that key (remember)
        self.calls: dict[tuple, Callable] = {}
        with _lock:
            _dispatchers[self.family] = self

    def plan_for(self, raw_key: tuple, device_index: int, kernel: str | None,
                 validate: Callable, args: tuple) -> Plan:
        """The hot path of every op: the cached plan for ``raw_key`` (one dict hit), or
        ``validate(*args)`` and a new plan. ``kernel`` forces a kernel by name; ``device_index``
        is the tensors' ``get_device()`` (-1 on the CPU), part of ``raw_key``. A cache hit
        costs ~0.3 µs of host time (CPU host, timeit), ~0.15 µs more than a dict look-up
        inline in the op; counting a miss adds ~0.05 µs."""
        plan = self.plans.get(raw_key if kernel is None else (raw_key, kernel))
        if plan is None:
            validate(*args)
            plan = self.plan(raw_key, device_index, kernel)
        if plan.miss_calls is not None:
            plan.miss_calls[0] += 1
        return plan

    def remember(self, call_key: tuple, plan: Plan, args: tuple) -> Callable:
        """The op's eager fast path for ``call_key``: ``plan``'s kernel bound to ``args`` (x, w,
        bias, out_dtype, scale_a, scale_b: a call the op has checked, whose key ``call_key``
        is), kept in ``calls`` and returned for the call at hand. A plan served by a fallback
        rule has the kept one count its calls as ``plan_for`` does (~0.1 µs more per call; an
        exact row's calls count nothing); the call at hand was counted by ``plan_for``."""
        bound = self.registry.bound_call(plan.decision.kernel_name, plan.run, *args)
        return self.remember_bound(call_key, plan, bound)

    def remember_bound(self, call_key: tuple, plan: Plan, bound: Callable) -> Callable:
        """``remember`` for an op that binds its plan itself (``bound``, made from ``plan``)."""
        with _lock:
            if plan.generation == _generation:  # else the tables changed while it was made
                self.calls[call_key] = (bound if plan.miss_calls is None
                                        else _counting(bound, plan.miss_calls))
        return bound

    def plan(self, raw_key: tuple, device_index: int | None = None,
             kernel: str | None = None) -> Plan:
        """The plan for ``raw_key`` on the device of a tensor with ``get_device() ==
        device_index``, made if it is not cached; ``kernel`` forces a kernel by name."""
        plan = self.plans.get(raw_key if kernel is None else (raw_key, kernel))
        if plan is None:
            plan = self._make_plan(raw_key, device_index, kernel)
        return plan

    def decide(self, key: tuple, device: DeviceId | None = None) -> Decision:
        """The row and rule that a call with the family's ``key`` would use, after checking that
        the row's kernel can run it (falling back to the default as a call would). No side
        effects besides loading the tables. A plain tuple is read as the key's columns in order."""
        if not isinstance(key, self.schema.key_type):
            key = self.schema.make_key(key)
        return self._decide_and_resolve(key, device or current_device())[0]

    def _decide_and_resolve(self, key: tuple, device: DeviceId) -> tuple[Decision, Callable]:
        problem = self.problem_of(key)
        match = table_index(self.schema, device).find(key)
        if match.row is None:
            name = self.default_kernel(key, device)
            return (Decision(self.family, key, Rule.default, name, None),
                    self.registry.resolve_for(name, problem))
        names = match.row.kernel_names(self.schema)
        names = (self.row_kernel(names),) if names else names
        similar = (f"similar-gpu: a row of {match.row.gpu or 'an unnamed GPU'} with this "
                   f"arch and SM count" if match.similar_gpu else "")
        decision = Decision(self.family, key, match.rule, names[0] if names else "", match.row,
                            note=similar)
        try:
            # Checked once here, so each call can skip its own checks.
            run = self.registry.resolve_for(decision.kernel_name, problem)
        except KernelNameError as e:
            source = decision.row.source if decision.row is not None else None
            _warn_unusable_row(e.why, str(e), str(source) if source else "")
            fallback = self.default_kernel(key, device)
            decision = Decision(self.family, key, Rule.default, fallback, decision.row,
                                note=f"row kernel unusable: {decision.kernel_name}")
            run = self.registry.resolve_for(fallback, problem)
        return decision, run

    def _forced(self, key: tuple, name: str) -> tuple[Decision, Callable]:
        run = self.registry.resolve_for(name, self.problem_of(key))
        return Decision(self.family, key, Rule.forced, name, None), run

    def _make_plan(self, raw_key: tuple, device_index: int | None, kernel: str | None) -> Plan:
        # Read the switches first: a bad value raises here, before anything is cached, so every
        # call raises the same error rather than only the first.
        log_it, capture_it = _env.log_tuned_config(), _env.capture_enabled()
        generation = _generation
        key = self.to_table_key(raw_key)
        outside = self.schema.why_not_key(key)
        if kernel is not None:
            decision, run = self._forced(key, kernel)
        elif outside:
            # An empty GEMM (M or K of 0) is a valid call no table can hold: the default runs
            # it, and it is not captured (an untuned file must hold only shapes it can tune).
            name = self.default_kernel(key, current_device(device_index))
            decision = Decision(self.family, key, Rule.default, name, None, note=outside)
            run = self.registry.resolve(name)
            capture_it = False
        else:
            decision, run = self._decide_and_resolve(key, current_device(device_index))
        miss = decision.rule not in (Rule.exact, Rule.forced)
        with _lock:
            miss_calls = _misses.setdefault((self.family, key), [0]) if miss else None
        plan = Plan(decision, run, miss_calls, generation)
        if log_it:
            _ensure_log_handler()
            log.info("gemmtune: %s", decision.describe(self.schema))
        if capture_it:
            try:
                record_shape(self.schema, key)
            except OSError as e:
                _warn_capture_failed(str(e))
        with _lock:
            if generation == _generation:  # else the tables changed while it was made
                self.plans[raw_key if kernel is None else (raw_key, kernel)] = plan
            if kernel is None:  # what report_misses tells; a forced call is never a miss
                _decisions[(self.family, key)] = decision
        return plan


def _counting(run: Callable, calls: list[int]) -> Callable:
    """``run``, counting its calls in ``calls[0]`` (with ``run``'s attributes)."""

    @functools.wraps(run)
    def counted(*args):
        calls[0] += 1
        return run(*args)

    return counted


_warned_reasons: set[str] = set()


def _warn_unusable_row(why: str, message: str, source: str) -> None:
    """One warning per reason: rows that fall back for the same reason (every cuBLASLt row where
    nvmath-python is missing) share it, instead of one warning each."""
    with _lock:
        if why in _warned_reasons:
            return
        _warned_reasons.add(why)
    where = f" (row {source})" if source else ""
    warnings.warn(f"{message}{where}; using the family default instead, here and for any other "
                  f"row with this reason. Retune this shape or remove the row.", stacklevel=3)


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
    family: str
    shape: dict
    rule: Rule
    kernel_name: str
    calls: int


def report_misses() -> list[Miss]:
    """Shapes that were not found exactly in a table, how often each was called, and the rule that
    served them instead, most frequent first."""
    with _lock:
        items = [(at, calls[0]) for at, calls in _misses.items() if calls[0]]
        decisions = dict(_decisions)
        dispatchers = dict(_dispatchers)
    report = []
    for (family, key), calls in sorted(items, key=lambda kv: -kv[1]):
        decision = decisions[(family, key)]
        names = dispatchers[family].schema.key_names
        report.append(Miss(family, dict(zip(names, key)), decision.rule, decision.kernel_name,
                           calls))
    return report


def format_misses(misses: list[Miss]) -> str:
    if not misses:
        return "no misses: every call found an exact table row"
    lines = [f"{'calls':>8}  {'family':<16} {'rule':<8} shape -> kernel"]
    for m in misses:
        shape = " ".join(f"{k}={v}" for k, v in m.shape.items())
        lines.append(f"{m.calls:>8}  {m.family:<16} {m.rule.value:<8} {shape} -> "
                     f"{m.kernel_name}")
    return "\n".join(lines)


def _forget_plans(family: str | None = None) -> None:
    """Forget loaded tables and plans (of one family, or all); call under ``_lock``."""
    global _generation
    _generation += 1
    for name in [family] if family else list(_indexes):
        _indexes.pop(name, None)
    for d in _dispatchers.values():
        if family is None or d.family == family:
            d.plans.clear()
            d.calls.clear()


def reset() -> None:
    """Forget loaded tables, plans and miss counts (after changing tables or variables)."""
    with _lock:
        _forget_plans()
        _indexes.clear()
        _misses.clear()
        _decisions.clear()
    with _lock:
        _warned_reasons.clear()
    _warn_capture_failed.cache_clear()
