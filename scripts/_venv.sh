# Sourced by the scripts beside it: make (or reuse) a virtual environment with gemmtune installed.
# With a CUDA GPU and a CUDA torch already on the system, the venv sees the system packages and
# installs nothing heavy; otherwise it installs the CPU build of torch (no multi-GB CUDA download).
set -euo pipefail
VENV=${GEMMTUNE_VENV:-.venv}
EXTRAS=${1:-}

system_has_cuda_torch() {
    python3 - <<'PY' 2>/dev/null
import torch, sys
sys.exit(0 if torch.cuda.is_available() else 1)
PY
}

if system_has_cuda_torch; then
    if [ ! -d "$VENV" ]; then
        # The system python may itself be a venv, whose packages --system-site-packages would not
        # show: point the new venv at its site folders with a .pth file instead.
        outer=$(python3 -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])')
        python3 -m venv "$VENV"
        inner=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        printf '%s\n' "$outer" > "$inner/_gemmtune_system_torch.pth"
    fi
    . "$VENV/bin/activate"
    python -m pip install -q --no-build-isolation --no-deps -e ".${EXTRAS}"
else
    [ -d "$VENV" ] || python3 -m venv "$VENV"
    . "$VENV/bin/activate"
    python -m pip install -q uv
    # uv ignores pip's configuration: hand it the local wheel folder pip is set up with, where the
    # CPU build of torch lies on these machines.
    links=$(python -m pip config get global.find-links 2>/dev/null || true)
    links=${PIP_FIND_LINKS:-$links}
    uv_args=(--compile-bytecode)
    [ -n "$links" ] && uv_args+=(--find-links "$links")
    if ! uv pip install -q "${uv_args[@]}" "torch==2.13.0+cpu" "triton>=3.8" -e ".${EXTRAS}"; then
        echo "note: torch==2.13.0+cpu is not in the local wheels; installing a CPU build of torch from PyTorch's index" >&2
        uv pip install -q "${uv_args[@]}" --torch-backend cpu torch "triton>=3.8" -e ".${EXTRAS}"
    fi
fi
