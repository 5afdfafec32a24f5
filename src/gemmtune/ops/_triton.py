"""A table row naming one of our Triton kernels (``triton.tile:...``, ``triton.splitk:...``,
``triton.persistent:...``) as a callable for dispatch: checked once per shape, then each call
only allocates and launches."""

from __future__ import annotations

from collections.abc import Callable

import torch


class TritonKernel:
    """``module`` is the kernel family's file: it provides ``why_not_supported``, a ``gemm_*``
    launcher that validates and a ``launch_gemm_*`` that does not, and the config class
    ``config_cls`` that parses the name. ``shape_of(table key)`` gives ``(M, N, K, input dtype,
    output dtype)`` of the family whose table holds the row."""

    def __init__(self, name: str, module, config_cls, launch, validating_launch,
                 shape_of: Callable[[tuple], tuple], block_scales: bool = False):
        self._module = module
        self._launch = launch
        self._validating_launch = validating_launch
        self._shape_of = shape_of
        self._block_scales = block_scales
        # Only block-scaled rows pass the flag: the common launch stays as short as it was.
        self._launch_kwargs = {"block_scales": True} if block_scales else {}
        self.config = config_cls.from_name(name)

    @classmethod
    def tile(cls, name: str, shape_of: Callable[[tuple], tuple],
             block_scales: bool = False) -> TritonKernel:
        from gemmtune.kernels.triton import gemm_tile as m

        return cls(name, m, m.TileConfig, m.launch_gemm_tile, m.gemm_tile, shape_of,
                   block_scales)

    @classmethod
    def splitk(cls, name: str, shape_of: Callable[[tuple], tuple],
               block_scales: bool = False) -> TritonKernel:
        from gemmtune.kernels.triton import gemm_splitk as m

        return cls(name, m, m.SplitKConfig, m.launch_gemm_splitk, m.gemm_splitk, shape_of,
                   block_scales)

    @classmethod
    def persistent(cls, name: str, shape_of: Callable[[tuple], tuple]) -> TritonKernel:
        from gemmtune.kernels.triton import gemm_persistent as m

        return cls(name, m, m.PersistentConfig, m.launch_gemm_persistent, m.gemm_persistent,
                   shape_of)

    def check(self, key: tuple) -> str | None:
        m, n, k, dtype, out_dtype = self._shape_of(key)
        problem = self._module.why_not_supported(self.config, m, n, k, dtype, out_dtype)
        if problem is None and self._block_scales:
            problem = self._module._checks.why_not_block_scaled(self.config, dtype)
        return problem

    def warmup(self, x, w, bias, out_dtype, scale_a, scale_b) -> None:
        """Compile for this call's arguments without running anything on the GPU."""
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y = torch.empty((x2.shape[0], w.shape[0]), dtype=out_dtype, device=x.device)
        if y.numel() and not self._module._checks.INTERPRETED:
            self._launch(x2, w, bias, y, scale_a, scale_b, self.config, warmup=True,
                         **self._launch_kwargs)

    def __call__(self, x, w, bias, out_dtype, scale_a, scale_b, out=None):  # x (..., K), w (N, K)
        if (scale_a is None) != (scale_b is None):
            # The validating launcher explains what is wrong.
            return self._validating_launch(x, w, bias, out_dtype, scale_a, scale_b, self.config,
                                           **self._launch_kwargs)
        n = w.shape[0]
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y = torch.empty((x2.shape[0], n), dtype=out_dtype, device=x.device) if out is None \
            else out.view(x2.shape[0], n)
        if y.numel():
            self._launch(x2, w, bias, y, scale_a, scale_b, self.config, **self._launch_kwargs)
        return y if x2 is x else y.view(x.shape[:-1] + (n,))


def json_config_or(fallback: str, registry, key: tuple, arch: str, tag: str, m: int, n: int,
                   k: int) -> str:
    """The kernel a per-(N, K) Triton JSON config file names for M's bucket, if there is one and
    it can run ``key``; else ``fallback``. A broken file warns once and is ignored."""
    import warnings

    from gemmtune.ops._dispatch import KernelNameError
    from gemmtune.tables import triton_json

    try:
        name = triton_json.lookup(arch, tag, n, k, m)
        if name is None:
            return fallback
        kernel = registry.resolve(name)
        problem = kernel.check(key) if hasattr(kernel, "check") else None
    except (ValueError, OSError, KernelNameError) as e:
        warnings.warn(f"gemmtune: Triton JSON config for N={n} K={k} ignored: {e}", stacklevel=2)
        return fallback
    if problem:
        warnings.warn(f"gemmtune: Triton JSON config {name} for N={n} K={k} cannot run M={m}: "
                      f"{problem}; using {fallback}", stacklevel=2)
        return fallback
    return name
