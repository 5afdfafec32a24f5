"""A cuBLASLt algorithm as a name: ``LtAlgo`` holds the nine attributes that fully describe one
(id, tile, stages, split-K, reduction scheme, CTA swizzle, custom option, cluster shape, inner
shape) and spells them as a ``kernelName``, e.g.
``cublaslt:id66.tile64x8.stages64xAUTO.sk4.red2.swz0.co1.cl1x2x1.in0``; ``algo_of`` reads them
back from a raw ``cublasLtMatmulAlgo_t``. ``matmul_algo_init`` + the attributes +
``matmul_algo_check`` rebuild the algorithm byte for byte (shared/notes/cublaslt-from-python.md;
``plans.Problem.build``). Names parse without nvmath or a GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gemmtune.kernels._names import Field, NameCodec, NamedConfig
from gemmtune.kernels.cublaslt._bindings import REDUCTION_SCHEMES, bindings, label, numpy, scalar

KERNEL_PREFIX = "cublaslt"

_NAME_CODEC = NameCodec("cuBLASLt algorithm", KERNEL_PREFIX, (
    Field("id", "algo_id"),
    Field("tile", "tile", r"[0-9]+x[0-9]+|UNDEFINED", str),
    Field("stages", "stages", r"[0-9]+x(?:[0-9]+|AUTO)|UNDEFINED", str),
    Field("sk", "split_k"),
    Field("red", "reduction"),
    Field("swz", "swizzle"),
    Field("co", "custom"),
    Field("cl", "cluster", r"[0-9]+x[0-9]+x[0-9]+|AUTO", str),
    Field("in", "inner"),
), form=(f"{KERNEL_PREFIX}:id<int>.tile<R>x<C>.stages<D>x<S|AUTO>.sk<int>.red<int>.swz<int>"
         f".co<int>.cl<X>x<Y>x<Z>|AUTO.in<int>, e.g. "
         f"{KERNEL_PREFIX}:id66.tile64x8.stages64xAUTO.sk4.red2.swz0.co1.cl1x2x1.in0"))


@dataclass(frozen=True)
class LtAlgo(NamedConfig):
    """One cuBLASLt algorithm. ``tile``, ``stages`` and ``cluster`` are the labels of cuBLASLt's
    enums without their prefix (``64x8`` for ``CUBLASLT_MATMUL_TILE_64x8``, ``64xAUTO``,
    ``1x2x1`` or ``AUTO``); the other fields are the attribute values as cuBLASLt stores them.
    ``from_name`` needs no nvmath or GPU."""

    NAME_CODEC = _NAME_CODEC

    algo_id: int
    tile: str
    stages: str
    split_k: int
    reduction: int
    swizzle: int
    custom: int
    cluster: str
    inner: int

    def __post_init__(self):
        for field in self.NAME_CODEC.fields:
            value = getattr(self, field.attr)
            if field.parse is str:  # an enum label: tile, stages, cluster
                ok = isinstance(value, str) and re.fullmatch(field.pattern, value)
            else:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            if not ok:
                raise ValueError(f"LtAlgo.{field.attr}={value!r} is not a valid value; the name "
                                 f"form is {self.NAME_CODEC.form}")
        if self.reduction not in REDUCTION_SCHEMES:
            raise ValueError(f"LtAlgo.reduction={self.reduction} must be one of "
                             f"{REDUCTION_SCHEMES} (none, in-place, compute type, output type)")


# ---------------------------------------------------------------------------------------------
# Reading a raw algorithm's attributes (its configuration and its capabilities).
# ---------------------------------------------------------------------------------------------

def _read_attr(raw, attr, dtype_of, getter) -> int:
    """One scalar attribute of an algorithm, sized by its own dtype query (some are uint16)."""
    value = scalar(dtype_of(attr))
    written = numpy().zeros(1, dtype=numpy().uint64)
    getter(raw.ctypes.data, int(attr), value.ctypes.data, value.itemsize, written.ctypes.data)
    return int(value[0])


def config_attr(raw, attr) -> int:
    """A configuration attribute (``MatmulAlgoConfigAttribute``) of a raw algorithm."""
    L = bindings()
    return _read_attr(raw, attr, L.get_matmul_algo_config_attribute_dtype,
                      L.matmul_algo_config_get_attribute)


def cap_attr(raw, attr) -> int:
    """A scalar capability (``MatmulAlgoCapAttribute``) of a raw algorithm."""
    L = bindings()
    return _read_attr(raw, attr, L.get_matmul_algo_cap_attribute_dtype,
                      L.matmul_algo_cap_get_attribute)


def cap_list(raw, attr) -> list[int]:
    """A list-valued capability (TILE_IDS, STAGES_IDS): ask for its size, then read it."""
    L, np = bindings(), numpy()
    dtype = np.dtype(L.get_matmul_algo_cap_attribute_dtype(attr))
    written = np.zeros(1, dtype=np.uint64)
    L.matmul_algo_cap_get_attribute(raw.ctypes.data, int(attr), 0, 0, written.ctypes.data)
    count = int(written[0]) // dtype.itemsize
    if count == 0:
        return []
    values = np.zeros(count, dtype=dtype)
    L.matmul_algo_cap_get_attribute(raw.ctypes.data, int(attr), values.ctypes.data,
                                    values.nbytes, written.ctypes.data)
    return [int(v) for v in values]


def algo_of(raw) -> LtAlgo | None:
    """The ``LtAlgo`` a raw cuBLASLt algorithm is, or None if nvmath cannot name its labels."""
    L = bindings()
    cfg = L.MatmulAlgoConfigAttribute
    tile = label(L.MatmulTile, "TILE_", config_attr(raw, cfg.TILE_ID))
    stages = label(L.MatmulStages, "STAGES_", config_attr(raw, cfg.STAGES_ID))
    cluster = label(L.ClusterShape, "SHAPE_", config_attr(raw, cfg.CLUSTER_SHAPE_ID))
    if tile is None or stages is None or cluster is None:
        return None
    return LtAlgo(algo_id=config_attr(raw, cfg.ID), tile=tile, stages=stages,
                  split_k=config_attr(raw, cfg.SPLITK_NUM),
                  reduction=config_attr(raw, cfg.REDUCTION_SCHEME),
                  swizzle=config_attr(raw, cfg.CTA_SWIZZLING),
                  custom=config_attr(raw, cfg.CUSTOM_OPTION),
                  cluster=cluster, inner=config_attr(raw, cfg.INNER_SHAPE_ID))
