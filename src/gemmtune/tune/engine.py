"""The tuning engine shared by every family.

For each untuned shape: ask a worker for the candidates, check each one against the fp32
reference and give it a quick timing (the screen), re-time the best few accurately, keep the
fastest unless the simplest valid candidate is within the measured noise of it, and write the row.
Rows are checkpointed every ``--batch`` shapes into the output table (atomic, under its lock, merged
with what is there), so a run killed at any moment and started again with the same command skips
what is done and loses nothing.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import queue
import re
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gemmtune import _env
from gemmtune.tables.schema import Schema
from gemmtune.tables.store import (Row, TableError, check_writable, full_key, read_table,
                                   update_table, write_table)
from gemmtune.tune.family import (CRASHING, Candidate, Evaluation, Status, FamilyTuner,
                                  TuneOptions)
from gemmtune.measure.gpulock import GpuLock
from gemmtune.tune.progress import Progress
from gemmtune.tune.records import CrashMemo, ProfileLog
from gemmtune.tune.workers import (START_TIMEOUT_S, Worker, WorkerLost, WorkerSpec,
                                   close_all)

# A candidate must beat the simplest valid one by more than this (or than the measured spread,
# whichever is larger) to be kept: below it, run-to-run drift on a shared GPU decides.
MIN_NOISE = 0.02


@dataclass(frozen=True)
class TuneConfig:
    input: Path
    output: Path
    profile: Path | None = None
    workers: int = 1
    options: TuneOptions = TuneOptions()
    batch: int = 10
    retune_all: bool = False
    last_only: bool = False
    sort: bool = False
    timeout: float = 60.0
    verbose: bool = False
    libtypes: frozenset[str] = frozenset()
    topk: int = 4
    compare: bool = False
    update_improved: bool = False
    min_improvement_pct: float = 3.0
    # Challengers only: the candidates whose names start with one of these (or match one with
    # wildcards), against each shape's
    # current row (its kernel re-timed in the same run) and the family's torch baseline.
    kernels: tuple[str, ...] = ()
    # CUDA_VISIBLE_DEVICES value per worker; empty: no GPU (hidden; Triton's CPU interpreter)
    gpus: tuple[str, ...] = ()


@dataclass
class ShapeResult:
    key: tuple
    row: Row | None
    evaluations: list[Evaluation]
    reason: str = ""


@dataclass
class RunSummary:
    tuned: int = 0
    failed: list[tuple] = field(default_factory=list)
    skipped: int = 0
    kept_old: int = 0
    bad_input: list[TableError] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    wall_s: float = 0.0
    compared: list[tuple[tuple, float | None, float]] = field(default_factory=list)
    interrupted: bool = False
    # Shapes tuned without some candidates that ran out of GPU memory twice.
    short_of_memory: list[tuple] = field(default_factory=list)
    # --kernels: shapes none of whose candidates the patterns named (tuned without a challenger)
    unchallenged: list[tuple] = field(default_factory=list)
    # status -> reason -> candidates: why candidates did not pass (wrong, error, refused)
    reasons: dict[str, Counter] = field(default_factory=dict)
    unsaved: str = ""  # why the output could not be written at the end, if it could not
    rescued_to: Path | None = None  # where the rows went instead

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return 130
        return 1 if self.failed or self.bad_input or self.unsaved else 0


def challenges(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether a kernel name is one ``--kernels`` names: it starts with a pattern, or matches
    one with wildcards (``triton.splitk:*SW1``)."""
    return any(fnmatch.fnmatchcase(name, p) if any(ch in p for ch in "*?[") else
               name.startswith(p) for p in patterns)


class RetuneLog:
    """Shapes finished by an ``--all`` / ``--update_improved`` / ``--kernels`` run, beside the
    output and named after the run's input and flags, so only the same command resumes from it."""

    def __init__(self, config: TuneConfig):
        self.active = config.retune_all or config.update_improved or bool(config.kernels)
        ident = hashlib.sha1(repr((str(config.input.resolve()), config.retune_all,
                                   config.update_improved, config.min_improvement_pct,
                                   sorted(config.libtypes), config.kernels)
                                  ).encode()).hexdigest()[:12]
        self.path = config.output.with_name(f"{config.output.name}.retune-{ident}.jsonl")

    def done(self) -> set[tuple]:
        if not self.path.exists():
            return set()
        keys = set()
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                keys.add(tuple(json.loads(line)))
            except ValueError:
                continue  # a torn last line: that shape is simply tuned again
        return keys

    def add(self, keys: list[tuple]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(list(k)) + "\n" for k in keys))

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


class Tuner:
    def __init__(self, factory: Callable[[], FamilyTuner], config: TuneConfig,
                 out=None):
        self.factory = factory
        self.family = factory()  # families construct without touching the GPU
        self.schema: Schema = self.family.schema
        if config.kernels and len(self.schema.kernel_columns) != 1:
            raise ValueError(f"--kernels challenges a row's one kernel; {self.schema.family} rows "
                             f"name {len(self.schema.kernel_columns)} "
                             f"({', '.join(self.schema.kernel_columns)}): tune it without it")
        self.config = config
        self.out = out or sys.stderr  # looked up now: a default bound at import may be closed
        self.memo = CrashMemo(self.schema)
        self.profile = ProfileLog(config.profile, self.schema) if config.profile else None
        self._inputs: dict[tuple, str] = {}  # per shape: how its inputs were made
        self.summary = RunSummary()
        self._pending: list[Row] = []
        self._lock = threading.RLock()  # _record checkpoints while holding it
        self._stop = threading.Event()
        self._finished = False  # every shape of the run tuned (set before the clean-up)
        self._progress: Progress | None = None
        self._finished_keys: list[tuple] = []
        self._retune_log = RetuneLog(config)
        self.device: tuple[str, int, str] = ("", 0, "")  # arch, cu_num, gpu of the rows
        self.env = ""

    # ------------------------------------------------------------------------------- the run
    def run(self) -> RunSummary:
        """Tune every shape of the input; ValueError before any work if an output cannot be
        written."""
        start = time.monotonic()
        check_writable(self.config.output, "tuned table (-o)")
        if self.config.profile is not None:
            check_writable(self.config.profile, "profile (-o2)")
        keys = self._read_input()
        workers = [Worker(self._spec(i), f"worker{i}") for i in range(max(1, self.config.workers))]
        for i, w in enumerate(workers):
            w.gpu = self.config.gpus[i % len(self.config.gpus)] if self.config.gpus else "cpu"
        self._gpu_locks = {w.gpu: GpuLock(w.gpu) for w in workers}
        restore = self._handle_stop_signals()
        try:
            info = workers[0].call("device", timeout=START_TIMEOUT_S)
            self.device, self.env = (info.arch, info.cu_num, info.gpu), info.env
            existing = self._existing_rows()
            todo = self._select(keys, existing)
            self._say(f"tuning {len(todo)} shape(s) of {self.schema.family} on "
                      f"{self._device_name()} with "
                      f"{len(workers)} worker(s); "
                      f"{self.summary.skipped} already tuned")
            self._tune_all(todo, workers, existing)
            self._finished = True
        except KeyboardInterrupt:
            self.summary.interrupted = True
        except OSError as e:  # the output became unwritable mid-run: its rows are rescued below
            self.summary.unsaved = f"could not write {self.config.output} ({e})"
        finally:
            self._stop.set()  # threads still inside a call must not take its end for a crash
            try:
                close_all(workers)
            finally:  # whatever the closing met, the finished rows are saved
                restore()
                self._save_pending()
                self.summary.wall_s = time.monotonic() - start
        if not self.summary.interrupted:
            self._retune_log.remove()
        self._report()
        return self.summary

    def _device_name(self) -> str:
        """ARCH:CU_NUM[:GPU], as DeviceId spells it: the crash memo's and the log's name."""
        return ":".join(str(v) for v in self.device if v != "")

    def _handle_stop_signals(self) -> Callable[[], None]:
        """Ctrl-C / SIGTERM: stop handing out shapes, keep every finished row, and leave the
        candidates that were running out of the crash memo (their worker did not crash)."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def stop(signum, frame):
            if self._finished:
                return  # every shape is done: the clean-up goes on and the run stays complete
            self.summary.interrupted = True
            if self._stop.is_set():
                # Already stopping: a second signal (coreutils' timeout sends SIGTERM to the
                # child and then to its whole process group) must not break off the clean-up,
                # which saves the rows not yet written.
                return
            self._stop.set()
            raise KeyboardInterrupt

        old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        return lambda: [signal.signal(sig, handler) for sig, handler in old.items()]

    def _save_pending(self) -> None:
        try:
            self._checkpoint()
        except Exception as e:
            # Never lose tuned rows: the output's folder may be the problem, so they go to the
            # cache folder (or, failing that, the system temp folder) for a later merge.
            self.summary.unsaved = f"could not write {self.config.output} ({e})"
            name = f"{self.config.output.name}.pending-{os.getpid()}.csv"
            for folder in (_env.cache_dir() / "rescue", Path(tempfile.gettempdir())):
                try:
                    write_table(folder / name, self.schema, self._pending)
                except OSError:
                    continue
                self.summary.rescued_to = folder / name
                break

    def _spec(self, index: int) -> WorkerSpec:
        if self.config.gpus:
            env = (("CUDA_VISIBLE_DEVICES", self.config.gpus[index % len(self.config.gpus)]),)
        else:
            # No GPU: Triton candidates run in its CPU interpreter (slow, and bf16 results are
            # wrong there: the correctness gate rejects them). A GPU the machine has stays hidden,
            # or torch would put the inputs on it, where interpreted kernels cannot run.
            env = (("TRITON_INTERPRET", "1"), ("CUDA_VISIBLE_DEVICES", ""))
        return WorkerSpec(self.factory, env)

    def _read_input(self) -> list[tuple]:
        read = read_table(self.config.input, self.schema, untuned=True, strict=False)
        for error in read.errors:
            self._say(f"bad input row, skipped: {error}")
        self.summary.bad_input = read.errors
        if self.config.last_only:
            keys = [read.rows[-1].key] if read.rows else []
        else:
            keys = list(dict.fromkeys(r.key for r in read.rows))  # unique, first-seen order
        if self.config.sort:
            keys.sort(key=self._sort_key)
        return keys

    def _sort_key(self, key: tuple) -> tuple:
        # Group shapes that share a weight (all but M), M ascending within a group.
        m = self.schema.m_index
        rest = key[:m] + key[m + 1:]
        # Numbers compare as numbers; strings (dtypes) among themselves: (is_str, value) pairs.
        return tuple((isinstance(v, str), v if isinstance(v, str) else int(v)) for v in rest) \
            + ((False, key[m]),)

    def _existing_rows(self) -> dict[tuple, Row]:
        if not self.config.output.exists():
            return {}
        rows = read_table(self.config.output, self.schema).rows
        return {full_key(r): r for r in rows}

    def _select(self, keys: list[tuple], existing: dict[tuple, Row]) -> list[tuple]:
        if self._retune_log.active:
            # Retuning rows that exist: the output cannot tell what this run already did, so a
            # sidecar lists the shapes it finished; the same command after an interruption skips
            # them. It is removed when the run completes.
            done = self._retune_log.done()
            todo = [k for k in keys if k not in done]
        else:
            todo = [k for k in keys if self.device + k not in existing]
        self.summary.skipped = len(keys) - len(todo)
        return todo

    def _tune_all(self, todo: list[tuple], workers: list[Worker],
                  existing: dict[tuple, Row]) -> None:
        tasks: queue.Queue = queue.Queue()
        for key in todo:
            tasks.put(key)
        progress = Progress(len(todo), f"tune {self.schema.family}", self.out)
        self._progress = progress
        errors: list[BaseException] = []

        def drain(worker: Worker) -> None:
            while not self._stop.is_set():
                try:
                    key = tasks.get_nowait()
                except queue.Empty:
                    return
                try:
                    result = self.tune_shape(worker, key, existing.get(self.device + key))
                    if self._stop.is_set():
                        return  # interrupted mid-shape: its result may be partial
                    self._record(result, existing.get(self.device + key), progress)
                except BaseException as e:  # the engine itself failed: stop, keep the rows
                    errors.append(e)
                    self._stop.set()
                    return

        threads = [threading.Thread(target=drain, args=(w,), daemon=True) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)  # short joins keep the main thread responsive to Ctrl-C
        if errors:
            raise errors[0]

    # --------------------------------------------------------------------------- one shape
    def tune_shape(self, worker: Worker, key: tuple, current: Row | None = None) -> ShapeResult:
        """Tune one shape; ``current``: its row in the output, if any (what ``--kernels``
        challenges)."""
        device = self._device_name()
        try:
            candidates = worker.call("candidates", key, self.config.libtypes,
                                     timeout=max(self.config.timeout, 300.0))
            if self.config.kernels:
                candidates = self._challenge(key, candidates, current)
        except WorkerLost as e:
            self._recover(worker)
            return ShapeResult(key, None, [], f"could not list candidates: {e}")
        except RuntimeError as e:  # the family refused the key (e.g. bpreshuffle=True)
            return ShapeResult(key, None, [], f"could not list candidates: {e}")
        if not candidates:
            return ShapeResult(key, None, [], "no candidate of the allowed backends fits")
        seed = secrets.randbits(31)  # fresh inputs for every shape and every run
        self._inputs[key] = self.family.inputs_note(seed)  # for the profile's lines
        try:
            # Inputs and reference first, on their own clock: their cost must never be charged
            # to (and memoised against) the first candidate.
            with self._gpu_lock(worker):  # random inputs and the reference GEMM run on the GPU
                worker.call("prepare", key, seed, timeout=max(self.config.timeout, 300.0))
        except (WorkerLost, RuntimeError) as e:
            if isinstance(e, WorkerLost):
                self._recover(worker)
            return ShapeResult(key, None, [], f"could not prepare inputs: {e}")
        evaluations = []
        for c in candidates:
            if self._stop.is_set():
                return ShapeResult(key, None, evaluations, "interrupted")
            evaluations.append(self._evaluate(worker, device, key, c, seed))
        evaluations = self._retry_out_of_memory(worker, device, key, candidates, evaluations,
                                                seed)
        if self._stop.is_set():
            return ShapeResult(key, None, evaluations, "interrupted")
        # A family whose candidates are parts of a solution (fmoe's stages) turns the screened
        # parts into whole solutions here; the re-timing then times those end to end.
        candidates, passing = self.family.compose(key, candidates,
                                                  [e for e in evaluations if e.ok])
        by_name = {c.name: c for c in candidates}
        if not passing:
            failures = Counter(e.status.value for e in evaluations)
            reason = "no candidate passed: " + ", ".join(f"{n} {s}" for s, n in failures.items())
            details = {e.detail.split(":")[0] for e in evaluations if e.status is Status.error}
            if len(evaluations) > 2 and failures == {"error": len(evaluations)} and \
                    len(details) == 1:
                reason += (f"; all raised {details.pop()}: that looks like a bug in the "
                           f"{self.schema.family} family rather than in its candidates "
                           f"(run with -v for the messages)")
            return ShapeResult(key, None, evaluations, reason)
        finalists = self._retime(worker, device, key, seed, passing, by_name)
        if not finalists:
            return ShapeResult(key, None, evaluations, "every finalist failed its re-timing")
        best = self._choose(finalists, by_name)
        fields = self.family.result_fields(key, by_name[best.name], best, self.env)
        arch, cu_num, gpu = self.device
        row = Row(arch, cu_num, key, fields, gpu=gpu)
        return ShapeResult(key, row, evaluations)

    def _retry_out_of_memory(self, worker: Worker, device: str, key: tuple,
                             candidates: list[Candidate], evaluations: list[Evaluation],
                             seed: int) -> list[Evaluation]:
        """One more try for the candidates that ran out of GPU memory: what the other workers held
        at that moment (their own shapes' inputs) may be gone by now."""
        retried = []
        for candidate, ev in zip(candidates, evaluations, strict=True):
            if ev.status is Status.oom and not self._stop.is_set():
                first_seconds = ev.seconds
                ev = self._evaluate(worker, device, key, candidate, seed)
                ev.seconds += first_seconds
            retried.append(ev)
        return retried

    def _evaluate(self, worker: Worker, device: str, key: tuple, candidate: Candidate,
                  seed: int) -> Evaluation:
        if candidate.refused:
            return Evaluation(candidate.name, Status.refused, detail=candidate.refused)
        if self.memo.skips(device, key, candidate.name, self.config.timeout):
            return Evaluation(candidate.name, Status.skipped,
                              detail=f"crashed or hung in an earlier run (see {self.memo.path})")
        # Build (compile) in parallel with the other workers; run, check and time one worker per
        # GPU at a time, so no candidate is timed while another shares its GPU.
        built = self._call_candidate(worker, device, key, candidate.name, "precompile", seed)
        if not built.ok:
            return built
        with self._gpu_lock(worker):
            ev = self._call_candidate(worker, device, key, candidate.name, "evaluate", seed)
        ev.seconds += built.seconds
        return ev

    def _gpu_lock(self, worker: Worker) -> GpuLock:
        return self._gpu_locks[worker.gpu]

    def _call_candidate(self, worker: Worker, device: str, key: tuple, name: str, method: str,
                        seed: int) -> Evaluation:
        started = time.monotonic()
        try:
            ev = worker.call(method, key, name, seed, self.config.options,
                             timeout=self.config.timeout)
        except WorkerLost as e:
            ev = Evaluation(name, e.status, detail=e.detail)
        except RuntimeError as e:  # the worker's own plumbing failed: treat as a crash
            ev = Evaluation(name, Status.crash, detail=str(e))
        ev.seconds = time.monotonic() - started
        if self._stop.is_set() and ev.status in CRASHING:
            return ev  # its worker was closed under it by an interrupt: not the candidate's fault
        if ev.ok and method != "precompile" and not (0 < ev.us < math.inf
                                                     and math.isfinite(ev.spread)):
            ev = Evaluation(name, Status.error, detail=f"timer returned us={ev.us} "
                                                       f"spread={ev.spread}")
        if ev.status in CRASHING or ev.fatal:
            hung_under = self.config.timeout if ev.status is Status.timeout else math.inf
            self.memo.add(device, key, name, f"{ev.status.value}: {ev.detail}", hung_under)
            self._recover(worker)
        if self.config.verbose:
            line = (f"  {name}: {ev.status.value} us={ev.us:.3f} spread={ev.spread:.3f} "
                    f"err_ratio={ev.err_ratio:.4f} {ev.detail}")
            self._progress.note(line) if self._progress else self._say(line)
        return ev

    def _recover(self, worker: Worker) -> None:
        if self._stop.is_set():
            return  # the run is closing its workers: a replacement would only be closed again
        try:
            worker.restart()
        except RuntimeError as e:
            raise RuntimeError(f"cannot replace a lost worker, stopping: {e}") from e

    def _retime(self, worker: Worker, device: str, key: tuple, seed: int,
                passing: list[Evaluation], by_name: dict[str, Candidate]) -> list[Evaluation]:
        """Re-time the fastest few of the screen, and the fastest valid candidate of each
        simplicity (what ``_choose`` keeps on a tie), accurately."""
        ranked = sorted(passing, key=lambda e: e.us)
        chosen = {e.name: e for e in ranked[: self.config.topk]}
        for e in ranked:
            if all(by_name[c.name].simplicity != by_name[e.name].simplicity
                   for c in chosen.values()):
                chosen[e.name] = e
        finalists = self._retime_together(worker, key, seed, chosen)
        if finalists is not None:
            return finalists
        if self._stop.is_set():
            return []
        finalists = []  # one of them failed the joint timing: time each alone to find which
        for screened in chosen.values():
            with self._gpu_lock(worker):
                ev = self._call_candidate(worker, device, key, screened.name, "retime", seed)
            if ev.ok:
                ev.err_ratio, ev.rel_err = screened.err_ratio, screened.rel_err
                finalists.append(ev)
        return finalists

    def _retime_together(self, worker: Worker, key: tuple, seed: int,
                         chosen: dict[str, Evaluation]) -> list[Evaluation] | None:
        """All finalists timed in one measurement, alternating, so that drift of the GPU's clocks
        hits each alike; None if that failed (the caller then times them one by one, which
        isolates a crasher)."""
        names = list(chosen)
        try:
            with self._gpu_lock(worker):
                timed = worker.call("retime_many", key, names, seed, self.config.options,
                                    timeout=self.config.timeout * len(names))
        except (WorkerLost, RuntimeError):
            # A raising family call may have left the process unusable (a sticky CUDA error): a
            # fresh worker, so the one-by-one timings below blame only their own candidate.
            if not self._stop.is_set():
                self._recover(worker)
            return None
        finalists = []
        for ev in timed:
            if not (0 < ev.us < math.inf and math.isfinite(ev.spread)):
                return None
            ev.err_ratio, ev.rel_err = chosen[ev.name].err_ratio, chosen[ev.name].rel_err
            finalists.append(ev)
            if self.config.verbose:
                line = f"  {ev.name}: re-timed us={ev.us:.3f} spread={ev.spread:.3f}"
                self._progress.note(line) if self._progress else self._say(line)
        return finalists

    def _choose(self, finalists: list[Evaluation], by_name: dict[str, Candidate]) -> Evaluation:
        """Fastest, unless a simpler candidate is within the measured noise of it."""
        fastest = min(finalists, key=lambda e: e.us)
        for simplicity in range(by_name[fastest.name].simplicity):
            simpler = [e for e in finalists if by_name[e.name].simplicity == simplicity]
            if not simpler:
                continue
            best_simple = min(simpler, key=lambda e: e.us)
            noise = max(MIN_NOISE, fastest.spread, best_simple.spread)
            if best_simple.us <= fastest.us * (1 + noise):
                return best_simple
        return fastest

    def _challenge(self, key: tuple, candidates: list[Candidate],
                   current: Row | None) -> list[Candidate]:
        """``--kernels``: the challengers (names the patterns match), the torch baseline, and
        the current row's kernel, as the family lists it or else as the row names it (a config
        the family no longer lists still competes). A shape none of whose candidates the
        patterns name is noted (the report lists it): its row is chosen between the rest."""
        incumbent = current.kernel_names(self.schema)[0] if current is not None else None
        challengers = {c.name for c in candidates if challenges(c.name, self.config.kernels)}
        if not challengers:
            with self._lock:
                self.summary.unchallenged.append(key)
        kept = [c for c in candidates if c.name in challengers or c.libtype == "torch"
                or c.name == incumbent]
        if incumbent is not None and all(c.name != incumbent for c in kept):
            kept.append(Candidate(incumbent, str(current.results.get("libtype", "")),
                                  splitk=int(current.results.get("splitK") or 0),
                                  solidx=len(candidates)))
        return kept

    # ------------------------------------------------------------------------- bookkeeping
    def _record(self, result: ShapeResult, old: Row | None, progress: Progress) -> None:
        with self._lock:
            for ev in result.evaluations:
                self.summary.statuses[ev.status.value] += 1
                if ev.status in (Status.wrong, Status.error, Status.refused):
                    # Why, without the measured numbers that differ from shape to shape.
                    why = ev.detail.split("\n")[0][:160]
                    if ev.status is not Status.refused:
                        why = re.sub(r"(?<![\w#.])\d[\d.e+-]*%?", "#", why)
                    self.summary.reasons.setdefault(ev.status.value, Counter())[why] += 1
            if result.row is not None and any(ev.status is Status.oom
                                              for ev in result.evaluations):
                self.summary.short_of_memory.append(result.key)
            if self.profile is not None and result.evaluations:
                self.profile.append(self.device, result.key, result.evaluations,
                                    self._inputs.pop(result.key, ""))
            shape = self.schema.describe_key(result.key)
            self._finished_keys.append(result.key)
            if result.row is None:
                self.summary.failed.append(result.key)
                progress.note(f"FAILED {shape}: {result.reason}")
                progress.update(shape, ok=False)
                return
            new_us = result.row.us
            if self.config.compare:
                self.summary.compared.append((result.key, old.us if old else None, new_us))
            if self._keep_old(old, new_us):
                self.summary.kept_old += 1
            else:
                self._pending.append(result.row)
                self.summary.tuned += 1
            names = "+".join(filter(None, (str(result.row.results[c])
                                           for c in self.schema.kernel_columns)))
            progress.update(f"{shape} -> {names} {new_us:.2f} us",
                            ok=True)
            if len(self._pending) >= self.config.batch:
                self._checkpoint()

    def _keep_old(self, old: Row | None, new_us: float) -> bool:
        if old is None or not self.config.update_improved:
            return False
        return new_us >= old.us * (1 - self.config.min_improvement_pct / 100)

    def _checkpoint(self) -> None:
        with self._lock:
            if self._pending:
                update_table(self.config.output, self.schema, self._pending)
                self._pending = []
            if self._finished_keys and self._retune_log.active:
                self._retune_log.add(self._finished_keys)  # only once their rows are saved
            self._finished_keys = []

    def _say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _report(self) -> None:
        s = self.summary
        if s.unsaved:
            where = (f"{len(self._pending)} tuned row(s) saved to {s.rescued_to}: add that file "
                     f"to {self.schema.env_names[0]} or copy its lines into the output"
                     if s.rescued_to else "the tuned rows could not be saved anywhere")
            self._say(f"{s.unsaved}; {where}")
        if s.interrupted:
            self._say(f"interrupted: {s.tuned} shape(s) tuned and saved in {self.config.output}; "
                      f"run the same command again to continue")
        shapes = s.tuned + s.kept_old + len(s.failed)
        per_shape = s.wall_s / shapes if shapes else 0.0
        statuses = ", ".join(f"{n} {k}" for k, n in sorted(s.statuses.items()))
        self._say(f"done in {s.wall_s:.1f} s ({per_shape:.1f} s/shape): {s.tuned} tuned, "
                  f"{len(s.failed)} failed, {s.skipped} already tuned"
                  + (f", {s.kept_old} kept (no {self.config.min_improvement_pct:g}% gain)"
                     if s.kept_old else "")
                  + (f", {len(s.bad_input)} bad input row(s)" if s.bad_input else "")
                  + f"; candidates: {statuses or 'none'}; output {self.config.output}")
        for status, reasons in sorted(s.reasons.items()):
            shown = "; ".join(f"{n} x {why}" for why, n in reasons.most_common(3))
            more = len(reasons) - 3
            self._say(f"  {status}: {shown}" + (f"; and {more} other reason(s) (-o2 lists every "
                                                 f"candidate)" if more > 0 else ""))
        if s.statuses[Status.oom.value]:
            self._say(f"{s.statuses[Status.oom.value]} candidate(s) ran out of GPU memory even on "
                      f"a second try; with fewer workers (--mp) each has more")
        if s.short_of_memory:
            self._say("  rows chosen without them (re-tune these shapes with --all and a smaller "
                      "--mp to let them compete):")
            for key in s.short_of_memory:
                self._say("    " + self.schema.describe_key(key))
        if s.unchallenged:
            self._say(f"  {len(s.unchallenged)} shape(s) had no candidate matching --kernels "
                      f"{','.join(self.config.kernels)} (a typo, or a kernel that cannot run "
                      f"them); their rows were chosen between their own kernel and torch's:")
            for key in s.unchallenged:
                self._say("    " + self.schema.describe_key(key))
        for key in s.failed:
            self._say("  failed: " + self.schema.describe_key(key))
        if s.compared:
            self._say(f"{'shape':<40} {'old us':>10} {'new us':>10}")
            for key, old, new in s.compared:
                shape = self.schema.describe_key(key)
                self._say(f"{shape:<40} {old if old is not None else '-':>10} {new:>10.3f}")


def default_gpus() -> tuple[str, ...]:
    """One worker per visible GPU; none pinned without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return ()
    visible = _env.visible_devices()
    if visible:
        return tuple(visible)
    return tuple(str(i) for i in range(torch.cuda.device_count()))
