"""K's splits of a tile summed inside a thread-block cluster (Hopper), for the Gluon decode kernels.

The split programs of one tile launch as one cluster. Each program but the first stores its fp32
partial into the first one's shared memory (distributed shared memory), the cluster meets at one
barrier, and the first adds the partials in split order and ends the tile. Without a cluster the
splits meet in global memory: partials stored, a counter's atomic, the last program's loads,
a chain of round trips at the end of a kernel of a few µs that cost 1.7-7.3 µs on an H100
(docs/benchmarks.md, session 21).

Triton 3.6 launches clusters only for kernels compiled with ``num_ctas`` above one, whose Gluon
layouts must all then say how tensors split across the cluster's programs. These kernels are
compiled for one program as ever; ``clustered`` sets the cluster's size in the compiled
kernel's launch metadata, and Triton's launcher then launches ``grid[0] x size`` programs along
x in clusters of ``size`` (``CUDA_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION``). So a tile's splits are
consecutive along the grid's first axis, the split a program's rank in its cluster.
"""

from __future__ import annotations

import ctypes
import functools

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# Splits a cluster takes: up to 8 programs is portable; Triton's launcher allows 16 on an H100
# (it sets the non-portable size attribute for 16 alone).
CLUSTER_SIZES = (2, 3, 4, 5, 6, 7, 8, 16)
# Triton versions whose compiled kernel packs its launch metadata as (num_warps, num_ctas,
# shared) and whose launcher takes num_ctas as the cluster's size along x.
_CLUSTER_LAUNCH_VERSIONS = ("3.6.",)
# fp32 partials an inline-PTX sum takes a thread (its operands: as many outputs)
MOST_PER_THREAD = 16
# The others' partials are a static shared array of the asm's (its address known to the asm),
# which ptxas allows up to 48 KiB.
MOST_SUM_BYTES = 48 * 1024
# CUDA's function attributes (CUfunction_attribute)
_STATIC_SHARED_BYTES = 1
_MAX_DYNAMIC_SHARED_BYTES = 8


def sum_bytes(splits: int, tile_elements: int) -> int:
    """Shared memory the first program of a cluster holds the others' partials in."""
    return (splits - 1) * tile_elements * 4


def why_not_cluster(splits: int, tile_elements: int, threads: int) -> str | None:
    """Why a tile of ``tile_elements`` fp32 over ``threads`` threads cannot have its ``splits``
    summed in a cluster, or None."""
    if splits not in CLUSTER_SIZES:
        return (f"split_k={splits} summed in a cluster: a cluster takes {CLUSTER_SIZES} "
                f"programs")
    if tile_elements % threads or tile_elements // threads > MOST_PER_THREAD:
        return (f"a tile of {tile_elements} fp32 over {threads} threads: the cluster's sum takes "
                f"whole elements a thread, at most {MOST_PER_THREAD}; use a smaller block_m")
    if sum_bytes(splits, tile_elements) > MOST_SUM_BYTES:
        return (f"split_k={splits} summed in a cluster: the others' partials of {tile_elements} "
                f"fp32 take {sum_bytes(splits, tile_elements)} B of static shared memory (at "
                f"most {MOST_SUM_BYTES}); use fewer splits or a smaller block_m")
    return None


def why_not_cluster_launch_here() -> str | None:
    """Why this Triton cannot launch a kernel compiled for one program in clusters, or None."""
    if triton.__version__.startswith(_CLUSTER_LAUNCH_VERSIONS):
        return None
    return (f"Triton {triton.__version__}: launching a one-program kernel in clusters is known "
            f"for Triton {', '.join(_CLUSTER_LAUNCH_VERSIONS)} only")


def clustered(compiled, size: int):
    """``compiled`` (Triton's ``CompiledKernel`` of a kernel compiled for one program) launched
    from now on in clusters of ``size`` programs along x: its grid's first axis counts clusters.
    Its specialisation must be its own (the kernel's cluster constexpr), as Triton's cache holds
    this one object for it. The sum's static array comes beside Triton's dynamic shared memory,
    which Triton sizes alone: the kernel is allowed its dynamic share whatever its size (beyond
    48 KiB in all CUDA asks for that)."""
    num_warps, _, shared = compiled.packed_metadata
    compiled._init_handles()  # the module loaded: its function and the attributes Triton set
    _allow_dynamic_shared(compiled.function, shared)
    compiled.packed_metadata = (num_warps, size, shared)
    return compiled


@functools.lru_cache(maxsize=None)
def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _allow_dynamic_shared(function: int, shared: int) -> None:
    """Let ``function`` launch with ``shared`` bytes of dynamic shared memory beside its static
    ones (Triton asks for more than 48 KiB only where its own dynamic share is)."""
    driver = _driver()
    static = ctypes.c_int()
    status = driver.cuFuncGetAttribute(ctypes.byref(static), _STATIC_SHARED_BYTES,
                                       ctypes.c_void_p(function))
    if status == 0 and static.value + shared > 48 * 1024:
        status = driver.cuFuncSetAttribute(ctypes.c_void_p(function), _MAX_DYNAMIC_SHARED_BYTES,
                                           shared)
    if status != 0:
        raise RuntimeError(f"CUDA error {status} allowing a clustered kernel {shared} B of "
                           f"dynamic shared memory beside its static array")


@gluon.constexpr_function
def _sum_asm(splits, per_thread, threads):
    """The inline PTX of ``cluster_sum``: $0..$(per_thread - 1) the sums, the next as many the
    thread's partials. Its own shared array (``red``, declared in the asm's scope: so the asm
    must be emitted once a thread, ``pack`` = per_thread) holds, in the first program, partial
    ``i`` of thread ``t`` of rank ``r`` at ((r - 1) x per_thread + i) x threads + t."""
    lines = [f".shared .align 16 .b8 red[{(splits - 1) * per_thread * threads * 4}];",
             ".reg .b32 rank, at, far, t4;", ".reg .pred lead;", ".reg .f32 v;",
             "mov.u32 rank, %cluster_ctarank;", "setp.eq.u32 lead, rank, 0;",
             "mov.u32 t4, %tid.x;", "shl.b32 t4, t4, 2;"]
    # Not the first: each partial into the first program's array, then the barrier (release:
    # the stores before it; acquire: the first reads after it).
    lines += ["@lead bra.uni PARTIALS_STORED;", "sub.u32 at, rank, 1;",
              f"mul.lo.u32 at, at, {per_thread * threads * 4};", "add.u32 at, at, t4;",
              "mov.u32 far, red;", "add.u32 at, at, far;",
              "mapa.shared::cluster.u32 far, at, 0;"]
    lines += [f"st.shared::cluster.f32 [far+{i * threads * 4}], ${per_thread + i};"
              for i in range(per_thread)]
    lines += ["PARTIALS_STORED:", "barrier.cluster.arrive.release.aligned;",
              "barrier.cluster.wait.acquire.aligned;"]
    lines += [f"mov.f32 ${i}, ${per_thread + i};" for i in range(per_thread)]
    # The first: its own partial, then the others' in rank order (as the splits' in-order sum).
    lines += ["@!lead bra.uni SUMMED;", "mov.u32 at, red;", "add.u32 at, at, t4;"]
    for r in range(1, splits):
        for i in range(per_thread):
            offset = ((r - 1) * per_thread + i) * threads * 4
            lines += [f"ld.shared.f32 v, [at+{offset}];", f"add.f32 ${i}, ${i}, v;"]
    lines += ["SUMMED:"]
    return "{\n" + "\n".join(lines) + "\n}"


@gluon.constexpr_function
def _constraints(per_thread):
    return ",".join(["=f"] * per_thread + ["f"] * per_thread)


@gluon.jit
def cluster_sum(out, SPLITS: gl.constexpr, PER_THREAD: gl.constexpr):
    """``out`` (fp32, PER_THREAD elements a thread) summed over the SPLITS programs of this
    program's cluster in rank order, valid in the first (rank 0); the others get their own
    back. Every thread of every program of the cluster must call it once."""
    return gl.inline_asm_elementwise(_sum_asm(SPLITS, PER_THREAD, gl.num_warps() * 32),
                                     _constraints(PER_THREAD), [out], dtype=gl.float32,
                                     is_pure=False, pack=PER_THREAD)
