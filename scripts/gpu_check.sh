#!/usr/bin/env bash
# The GPU checks of issue 9, on a fresh NVIDIA machine (RTX 3090 sm_86 or H100/H200 sm_90), in
# under 8 minutes: install what is missing, run the compile check and every GPU test (kernels
# against the CPU numerics, the GPU model against the CPU engine, graphs against uncaptured
# passes), print both tables of `duet bench gpu` (W4 GEMV bandwidth; decode cycle against the bill
# of bytes). Run from anywhere: bash scripts/gpu_check.sh
#
# Installs into the Python that runs it (PYTHON, default python3): an image that already has CuPy
# keeps it. Only modules that are missing are installed: from PyPI, or with no network from wheels
# in $WHEELS (default .whl in the repo root), made on a networked machine for the GPU machine's
# Python, e.g. for pure-Python ones:
#   pip download --no-deps -d .whl gguf platformdirs pyyaml tqdm requests
# (GPU machines of this project lack at least gguf and platformdirs; the tests need no torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# module -> distribution, for what the GPU tests and the benchmark import
missing=$("$PY" - <<'PYEOF'
import importlib.util
needed = {"cupy": "cupy-cuda12x", "numpy": "numpy", "gguf": "gguf", "safetensors": "safetensors",
          "tokenizers": "tokenizers", "jinja2": "jinja2", "httpx": "httpx", "huggingface_hub": "huggingface-hub",
          "platformdirs": "platformdirs", "pytest": "pytest"}
print(" ".join(dist for module, dist in needed.items() if importlib.util.find_spec(module) is None))
PYEOF
)
if [ -n "$missing" ]; then
    echo "installing: $missing"
    case " $missing " in *" cupy-cuda12x "*) missing="$missing cuda-toolkit[cudart,nvrtc]==12.*" ;; esac
    if [ -d "$WHEELS" ]; then
        "$PY" -m pip install -q --no-index --find-links "$WHEELS" $missing
    else
        "$PY" -m pip install -q $missing
    fi
fi
"$PY" -c "from engine.backend.select import backend_name; assert backend_name('auto') == 'cupy', 'no GPU or no CuPy'"

unset DUET_BACKEND  # the GPU model is chosen because the GPU is there

echo "== compile check (sm_86, sm_90) and GPU tests"
"$PY" -m pytest -q -s -p no:cacheprovider tests/engine/test_kernels_compile.py tests/engine/test_gpu_kernels.py \
    tests/engine/test_gpu_model.py tests/app/test_bench_gpu.py

echo "== W4 GEMV bandwidth and the decode cycle, both routes (tests took ${SECONDS}s)"
"$PY" -m duet.app.cli bench gpu --repeats 10
echo "== done in ${SECONDS}s"
