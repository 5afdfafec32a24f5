"""The switches that send an eager GEMM call the full way (a compile, autocast, autograd), looked
up once for the hot paths that read them (the bf16 op and TunedLinear).

``torch.compiler.is_compiling()`` is two Python calls; what it answers is read directly:
dynamo folds ``is_dynamo_compiling()`` to True where it traces, and torch.export sets the flag.
"""

from __future__ import annotations

import torch

dynamo_compiling = torch.compiler.is_dynamo_compiling
compiler = torch.compiler
any_autocast = torch._C._is_any_autocast_enabled
grad_enabled = torch.is_grad_enabled
if not hasattr(compiler, "_is_compiling_flag"):  # a torch without it: is_compiling's answer
    dynamo_compiling = torch.compiler.is_compiling
    compiler = type("_NeverCompiling", (), {"_is_compiling_flag": False})
