"""What a tuning run leaves behind besides the tuned table: the crash memo and the profile file."""

from __future__ import annotations

import csv
import io
import json
import math
import threading
from pathlib import Path

from gemmtune import _env
from gemmtune.tables.schema import Schema
from gemmtune.tables.store import lock_for
from gemmtune.tune.family import Evaluation


class CrashMemo:
    """Candidates that hung or killed their worker, per device and shape, so a rerun skips them
    instead of paying the timeout or the crash again. JSON lines, appended under a lock."""

    def __init__(self, schema: Schema, path: Path | None = None):
        self.path = path or _env.cache_dir() / "crash_memo" / f"{schema.family}.jsonl"
        # id -> the --timeout it hung under (inf for crashes): a later run with a longer timeout
        # gives a hung candidate another chance, a crash is never retried.
        self._known: dict[tuple, float] = {}
        self._lock = threading.Lock()
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self._known[self._id(entry["device"], entry["key"], entry["name"])] = float(
                        entry.get("timeout") or math.inf)
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line from a killed run: the candidate is retried

    @staticmethod
    def _id(device: str, key, name: str) -> tuple:
        return device, tuple(key), name

    def skips(self, device: str, key: tuple, name: str, timeout: float) -> bool:
        """Whether to skip ``name``: it crashed before, or hung under a timeout at least as long
        as ``timeout``."""
        hung_under = self._known.get(self._id(device, key, name))
        return hung_under is not None and hung_under >= timeout

    def add(self, device: str, key: tuple, name: str, reason: str,
            timeout: float = math.inf) -> None:
        with self._lock:
            self._known[self._id(device, key, name)] = timeout
            self.path.parent.mkdir(parents=True, exist_ok=True)
            line = json.dumps({"device": device, "key": list(key), "name": name,
                               "reason": reason,
                               "timeout": None if math.isinf(timeout) else timeout}) + "\n"
            with lock_for(self.path), open(self.path, "a", encoding="utf-8") as f:
                f.write(line)


PROFILE_COLUMNS = ("kernelName", "status", "us", "spread", "err_ratio", "rel_err", "seconds",
                   "detail", "inputs")


class ProfileLog:
    """``-o2/--profile_file``: one line per candidate evaluation, appended per shape under a lock
    (a log, not a table: several tuners may append to it)."""

    def __init__(self, path: Path, schema: Schema):
        self.path = path
        self.schema = schema
        self.header = ",".join(("arch", "cu_num", "gpu", *schema.key_names, *PROFILE_COLUMNS))
        if path.is_file() and path.stat().st_size:
            with open(path, encoding="utf-8") as f:
                found = f.readline().rstrip("\r\n")
            if found != self.header:
                raise ValueError(f"{path}: a profile with other columns ({found[:80]}...); name "
                                 f"another -o2 file, or move this one away, so that its lines "
                                 f"stay readable")

    def append(self, device: tuple[str, int, str], key: tuple, evaluations: list[Evaluation],
               inputs: str = "") -> None:
        """``device``: (arch, cu_num, gpu), the columns the profile starts with; ``inputs``: how
        the shape's inputs were made (the seed, fmoe's routing)."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        for ev in evaluations:
            writer.writerow([*device, *key, ev.name, ev.status.value, _num(ev.us),
                             _num(ev.spread), _num(ev.err_ratio), _num(ev.rel_err),
                             format(ev.seconds, ".3f"), ev.detail, inputs])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with lock_for(self.path):
            new = not self.path.exists() or self.path.stat().st_size == 0
            with open(self.path, "a", encoding="utf-8", newline="") as f:
                if new:
                    f.write(self.header + "\n")
                f.write(out.getvalue())


def _num(value: float) -> str:
    return format(value, ".6g")
