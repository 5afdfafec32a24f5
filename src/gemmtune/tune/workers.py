"""Worker processes that run candidates, so nothing a candidate does can hang or kill the tuner.

Each worker is a spawned process holding one family object (and its CUDA context, pinned to one
GPU). The parent sends one request at a time and waits at most ``timeout`` seconds for the answer;
a worker that does not answer is killed, one that dies (abort, segfault, ``os._exit``, illegal
address) is noticed by its closed pipe, and either way the caller gets an exception and starts a
fresh worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from gemmtune.measure.accuracy import gate
from gemmtune.tune.family import Evaluation, Prepared, Status, FamilyTuner, TuneOptions

# Spawning a worker imports torch (~2-5 s) and may initialise CUDA: allow generous time.
START_TIMEOUT_S = 300.0


class WorkerLost(RuntimeError):
    """The worker died or stopped answering; ``status`` says which."""

    def __init__(self, status: Status, detail: str):
        self.status = status
        self.detail = detail
        super().__init__(detail)


@dataclass(frozen=True)
class WorkerSpec:
    """How to make a worker: the family factory (a picklable top-level callable) and the
    environment it runs with (e.g. ``CUDA_VISIBLE_DEVICES``)."""

    factory: Callable[[], FamilyTuner]
    env: tuple[tuple[str, str], ...] = ()


# ------------------------------------------------------------------------ in the worker process
class _WorkerState:
    def __init__(self, family: FamilyTuner):
        self.family = family
        self.prepared: Prepared | None = None

    def prepared_for(self, key: tuple, seed: int) -> Prepared:
        # One shape's inputs at a time: candidates of a shape arrive back to back.
        if self.prepared is None or self.prepared.key != key or self.prepared.seed != seed:
            self.prepared = None
            self.prepared = self.family.prepare(key, seed)
        return self.prepared

    def device(self):
        return self.family.device_info()

    def prepare(self, key: tuple, seed: int) -> None:
        try:
            self.prepared_for(key, seed)
        finally:
            _release_cached_gpu_memory()

    def candidates(self, key, libtypes):
        return self.family.candidates(key, libtypes)

    def precompile(self, key: tuple, name: str, seed: int, options: TuneOptions) -> Evaluation:
        # Outside the GPU lock, but a warm-up launch (or inputs rebuilt after a restart) still
        # allocates on the GPU: the cache goes back here too.
        try:
            self.family.precompile(name, self.prepared_for(key, seed))
            return Evaluation(name, Status.ok)
        except Exception as e:
            if _out_of_memory(e):
                return Evaluation(name, Status.oom, detail="building: " + _describe(e))
            return Evaluation(name, Status.error, detail="building: " + _describe(e),
                              fatal=self.family.is_fatal(e))
        finally:
            _release_cached_gpu_memory()

    def evaluate(self, key: tuple, name: str, seed: int, options: TuneOptions) -> Evaluation:
        """Check ``name`` against the fp32 reference, then give it a quick timing."""
        family = self.family
        try:
            prepared = self.prepared_for(key, seed)
            out = family.run(name, prepared)
            atol, rtol, bound = family.tolerance(key)
            result = gate(out, prepared.reference, atol=atol, rtol=rtol,
                          max_err_ratio=options.err_ratio, rel_bound=bound)
            del out
            if not result.ok:
                return Evaluation(name, Status.wrong, result.err_ratio, result.rel_err,
                                  detail=result.detail)
            us, spread = family.time(name, prepared, options.iters, options.warmup)
            return Evaluation(name, Status.ok, result.err_ratio, result.rel_err, us, spread)
        except Exception as e:  # the candidate's own failure: report it, keep the worker
            if _out_of_memory(e):  # never sticky: not a reason to replace the worker
                return Evaluation(name, Status.oom, detail=_describe(e))
            return Evaluation(name, Status.error, detail=_describe(e),
                              fatal=family.is_fatal(e) or not _device_healthy())
        finally:
            _release_cached_gpu_memory()

    def retime(self, key: tuple, name: str, seed: int, options: TuneOptions) -> Evaluation:
        try:
            prepared = self.prepared_for(key, seed)
            us, spread = self.family.time(name, prepared, options.accurate_iters, options.warmup)
            return Evaluation(name, Status.ok, us=us, spread=spread)
        except Exception as e:
            return Evaluation(name, Status.oom if _out_of_memory(e) else Status.error,
                              detail=_describe(e), fatal=self.family.is_fatal(e))
        finally:
            _release_cached_gpu_memory()

    def retime_many(self, key: tuple, names: list[str], seed: int,
                    options: TuneOptions) -> list[Evaluation]:
        """Time ``names`` against each other (``FamilyTuner.time_many``); raises on any failure,
        so that the engine falls back to timing each alone."""
        try:
            prepared = self.prepared_for(key, seed)
            timed = self.family.time_many(names, prepared, options.accurate_iters, options.warmup)
        finally:
            _release_cached_gpu_memory()
        return [Evaluation(name, Status.ok, us=us, spread=spread)
                for name, (us, spread) in zip(names, timed, strict=True)]


def _release_cached_gpu_memory() -> None:
    """Give the blocks PyTorch caches (CUDA-graph pools and outputs of the call just made) back
    to the driver before the GPU lock passes on. Workers take turns on one GPU, and a large shape
    needs tens of GiB: the next worker must not run out of memory because this one keeps its
    cache (seen on H100: 8 workers, lm_head at M = 8192, 148 candidates lost)."""
    import torch

    # A sticky CUDA error raised here reaches the engine as a failure of the call just made,
    # which caused it, rather than of the next candidate.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _out_of_memory(e: BaseException) -> bool:
    """torch's own allocation failures, and the ones Triton, cuBLAS(Lt) and nvmath report as
    plain errors; none leaves the CUDA context unusable."""
    import torch

    text = str(e).lower()
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in text \
        or "alloc_failed" in text


def _device_healthy() -> bool:
    """After a candidate raised: can this process still use its GPU? A sticky CUDA error (an
    illegal address) makes every later call fail, whatever the first message said."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return True
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return True
    except Exception:
        return False


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 400 else text[:400] + "..."


def _die_with_parent() -> None:
    """Linux: have the kernel kill this worker when the tuner dies, even by SIGKILL, so a hung
    candidate never outlives the run."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _worker_main(conn, spec: WorkerSpec) -> None:
    _die_with_parent()
    os.environ.update(dict(spec.env))
    # The parent handles Ctrl-C; a worker must not die mid-answer from the terminal's SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        state = _WorkerState(spec.factory())
    except BaseException:
        conn.send(("init_error", traceback.format_exc(limit=5)))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        method, args = request
        try:
            conn.send(("ok", getattr(state, method)(*args)))
        except Exception as e:
            conn.send(("error", _describe(e)))


# ------------------------------------------------------------------------ in the parent process
_ENVIRON_LOCK = threading.Lock()
# How long closing waits for the workers to exit before killing them (one mid-call finishes
# the call first): it bounds a run's clean-up, whose rows are saved only after it
CLOSE_WAIT_S = 5.0


@contextlib.contextmanager
def _environment(env: dict):
    """``os.environ`` with ``env`` set, for a worker started inside: it must have its
    environment before it imports anything (importing triton under TRITON_INTERPRET=1 makes
    its own library functions interpretable; set later, the interpreter cannot call them)."""
    with _ENVIRON_LOCK:
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


class Worker:
    def __init__(self, spec: WorkerSpec, label: str = "worker"):
        self.spec = spec
        self.label = label
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._conn = None
        self.restarts = 0
        self._closed = False
        self.gpu = "cpu"  # which device it runs on: workers sharing one take turns to time

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def start(self) -> None:
        if self._closed:  # a restart racing close_all must not leave a process behind
            raise WorkerLost(Status.crash, f"{self.label} was closed")
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_worker_main, args=(child, self.spec),
                                       name=f"gemmtune-{self.label}", daemon=True)
        with _environment(dict(self.spec.env)):
            self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"{self.label}: did not start within {START_TIMEOUT_S:.0f} s")
        try:
            kind, payload = parent.recv()
        except EOFError:
            code = self._reap()
            raise RuntimeError(f"{self.label}: died while starting ({_exit_text(code)})") from None
        if kind != "ready":
            self.kill()
            raise RuntimeError(f"{self.label}: could not set up its family:\n{payload}")

    def restart(self) -> None:
        self.kill()
        self.restarts += 1
        self.start()

    def call(self, method: str, *args, timeout: float | None):
        """Run ``method(*args)`` in the worker. Raises WorkerLost (and leaves the worker dead) if
        it does not answer within ``timeout`` seconds or dies meanwhile."""
        if self._closed:
            raise WorkerLost(Status.crash, f"{self.label} was closed")
        if not self.alive:
            self.start()
        try:
            self._conn.send((method, args))
            ready = self._conn.poll(timeout)
        except (BrokenPipeError, EOFError, OSError):
            ready = True  # died before reading: the recv below reports how
        if not ready:
            self.kill()
            raise WorkerLost(Status.timeout, f"no answer within {timeout:g} s; worker killed")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            code = self._reap()
            raise WorkerLost(Status.crash, f"worker died: {_exit_text(code)}") from None
        if kind == "error":
            raise RuntimeError(f"{self.label}: {method} failed: {payload}")
        return payload

    def _reap(self) -> int | None:
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        return self._proc.exitcode

    def kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def ask_to_stop(self) -> None:
        """Closed from now on; the process is told to exit once its call (if any) is done."""
        self._closed = True
        conn = self._conn
        if self.alive and conn is not None:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass

    def finish_closing(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for the process to exit, then kill it if it has not."""
        proc = self._proc
        if proc is not None and proc.is_alive():  # a process made but not started cannot join
            proc.join(wait_s)
        self.kill()


def close_all(workers: list[Worker]) -> None:
    """Close ``workers`` together: all are told to exit before any is waited for, so their
    exits (each process's CUDA teardown) overlap instead of adding up. One that fails to close
    does not keep the others open; its error is raised once all are done."""
    errors = []
    for w in workers:
        try:
            w.ask_to_stop()
        except Exception as e:  # the others must still be closed
            errors.append(e)
    deadline = time.monotonic() + CLOSE_WAIT_S
    for w in workers:
        try:
            w.finish_closing(max(0.0, deadline - time.monotonic()))
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"
