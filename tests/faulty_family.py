"""A test-only tuning family whose candidates misbehave in every way a real kernel can.

Lives in tests/ (never in the package). Workers import it by name: the spawned worker inherits
the parent's sys.path, which pytest has extended with this folder.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from gemmtune.families import get_family
from gemmtune.tune.family import Candidate, DeviceInfo, FamilyTuner, Prepared

# name -> synthetic µs for the candidates that compute the right answer
GOOD = {"torch.linear": 10.0, "good.fast": 5.0, "good.slow": 8.0}
FAULTS = ("fault.raise", "fault.hang", "fault.exit", "fault.abort", "fault.segv", "fault.wrong",
          "fault.nan", "fault.unwritten", "fault.cudaerr", "fault.build", "fault.nantime",
          "fault.retimecrash")
# Right answers, bad timings: a NaN time, and the fastest screen that crashes when re-timed.
TIMING_FAULTS = {"fault.nantime": float("nan"), "fault.retimecrash": 1.0}
# Right answers after running out of GPU memory: on the first call in a worker, or on every one.
OUT_OF_MEMORY = {"oom.once": 3.0, "oom.always": 2.0}


class FaultyFamily(FamilyTuner):
    schema = get_family("bf16").schema
    timing_label = "synthetic"

    def device_info(self):
        return DeviceInfo("cpu", 0, os.environ.get("FAULTY_GPU", ""), "test")

    def candidates(self, key, libtypes):
        names = list(GOOD)
        if os.environ.get("FAULTY_WITH_FAULTS", "1") == "1":
            names += FAULTS
        if os.environ.get("FAULTY_CANDIDATES"):
            names = os.environ["FAULTY_CANDIDATES"].split(",")
        return [Candidate(n, n.split(".")[0], simplicity=0 if n == "torch.linear" else 2,
                          solidx=i) for i, n in enumerate(names)]

    def prepare(self, key, seed):
        m, n, k = key.M, key.N, key.K
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(m, k, generator=gen)
        w = torch.randn(n, k, generator=gen) / k ** 0.5
        return Prepared(key, seed, (x, w), x @ w.t())

    def precompile(self, name, prepared):
        if name == "fault.build":
            raise RuntimeError("this candidate does not compile")
        if name == "oom.build":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def run(self, name, prepared):
        x, w = prepared.inputs
        out = torch.full((x.shape[0], w.shape[0]), float("nan"))
        if name in OUT_OF_MEMORY and (name == "oom.always" or name not in self.ran_out):
            self.ran_out.add(name)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if name == "oom.text":  # as Triton reports a failed allocation: a plain RuntimeError
            raise RuntimeError("Triton Error [CUDA]: out of memory")
        if name in GOOD or name in TIMING_FAULTS or name in OUT_OF_MEMORY:
            return torch.matmul(x, w.t(), out=out)
        if name.startswith("fault.raise"):
            raise ValueError("this candidate always raises")
        if name == "fault.hang":
            time.sleep(3600)
        if name == "fault.exit":
            os._exit(3)
        if name == "fault.abort":
            os.abort()
        if name == "fault.segv":
            os.kill(os.getpid(), signal.SIGSEGV)
            time.sleep(10)
        if name == "fault.wrong":
            return torch.matmul(x, w.t(), out=out).add_(0.5)
        if name == "fault.nan":
            torch.matmul(x, w.t(), out=out)
            out[0, 0] = float("nan")
            return out
        if name == "fault.unwritten":
            return out
        if name == "fault.cudaerr":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        raise ValueError(f"unknown candidate {name}")

    def time_many(self, names, prepared, iters, warmup):
        log = os.environ.get("FAULTY_GROUP_LOG")
        if log:  # which finalists were timed together
            with open(log, "a") as f:
                f.write(",".join(names) + "\n")
        if os.environ.get("FAULTY_GROUP_POISONS") == "1":
            # A sticky error: this process fails every later call, as after an illegal address.
            FaultyFamily.poisoned = True
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().time_many(names, prepared, iters, warmup)

    poisoned = False
    ran_out: set[str] = set()  # per worker process

    def tolerance(self, key):
        return 1e-4, 1e-4, 1e-4

    def time(self, name, prepared, iters, warmup):
        if FaultyFamily.poisoned:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        start = time.time()
        time.sleep(float(os.environ.get("FAULTY_TIME_SLEEP", "0")))
        log = os.environ.get("FAULTY_TIMING_LOG")
        if log:  # to check that no two workers time at once
            with open(log, "a") as f:
                f.write(f"{start} {time.time()}\n")
        if name in TIMING_FAULTS:
            if name == "fault.retimecrash" and iters > 20:
                os._exit(5)
            return TIMING_FAULTS[name], 0.01
        # Deterministic per shape, so interrupted and uninterrupted runs give the same rows.
        return {**GOOD, **OUT_OF_MEMORY}[name] + prepared.key.M / 1000, 0.01
