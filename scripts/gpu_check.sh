#!/usr/bin/env bash
# Every GPU check in one short run that fits a 15-minute GPU window with room for a rerun (the stages'
# limits add up to 9 minutes), on an NVIDIA machine with no network:
#   bash scripts/gpu_check.sh OUT_DIR          (on the device machine: bash scripts/gpu_check.sh "$OUT")
#
# Stages, each with its own time limit, its log written to OUT_DIR/<stage>.log as it runs and its
# result added to OUT_DIR/summary.json when it ends, so a run cut off still returns what it measured:
#   setup     what the machine lacks, from wheels carried with the working tree; CuPy >= 14 required
#   compile   every kernel compiled for sm_86 and sm_90 (register and spill report)
#   kernels   the kernels against the CPU numerics
#   model     the GPU model against the CPU engine; graphs against uncaptured passes
#   flash     Flash-Next (qwen4_exp: hyper-connections, PLE, QSA) on the GPU against the CPU engine
#   gemv      W4 GEMV bytes/s against copy bandwidth, 1 to 16 rows, both routes (duet bench gpu)
#   cycle     decode cycle time against the bill of bytes, 27B geometry (duet bench gpu)
#
# Missing Python packages come from $WHEELS (default .whl in the repo root), which the device tool
# carries (`carry: [".whl"]`; keep it out of git with `echo /.whl/ >> .git/info/exclude`). Make it
# here, for the GPU machine's Python (3.12 on this project's H200 image, which lacks gguf and
# platformdirs; it has CuPy 14, numpy, numba, safetensors, tokenizers, jinja2, httpx and pytest):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf platformdirs
# A machine without CuPy needs it and its CUDA libraries as wheels too (cupy-cuda12x, and
# nvidia-cublas-cu12, nvidia-cuda-nvrtc-cu12, nvidia-cuda-runtime-cu12 for its cuBLAS and NVRTC).
# duet itself runs from this checkout: a `duet` package of links to engine/, app/ and models/.
set -uo pipefail
out="${1:?give a folder for the logs and summary.json, e.g. bash scripts/gpu_check.sh \"\$OUT\"}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-$repo/.whl}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
summary="$out/summary.json"
echo '{}' >"$summary"

# stage NAME SECONDS COMMAND...: runs it under its limit, its output to OUT/NAME.log and the screen,
# its exit code and seconds into summary.json (124: cut off at its limit)
stage() {
    local name=$1 limit=$2 started=$SECONDS rc
    shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    rc=${PIPESTATUS[0]}
    "$PY" - "$summary" "$name" "$rc" "$((SECONDS - started))" <<'PYEOF'
import json, sys
path, name, rc, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
summary = json.load(open(path))
summary[name] = {"exit_code": rc, "seconds": seconds, "result": "passed" if rc == 0 else "cut off" if rc == 124 else "failed"}
json.dump(summary, open(path, "w"), indent=1)
PYEOF
    return "$rc"
}

setup() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || return 1
    local site=/tmp/duet-site
    rm -rf "$site" && mkdir -p "$site/duet"
    touch "$site/duet/__init__.py"
    for part in engine app models; do ln -s "$repo/$part" "$site/duet/$part"; done
    missing=$("$PY" - <<'PYEOF'
import importlib.util
needed = {"cupy": "cupy", "numpy": "numpy", "numba": "numba", "gguf": "gguf", "safetensors": "safetensors",
          "tokenizers": "tokenizers", "jinja2": "jinja2", "httpx": "httpx", "huggingface_hub": "huggingface-hub",
          "platformdirs": "platformdirs", "threadpoolctl": "threadpoolctl", "pytest": "pytest"}
print(" ".join(dist for module, dist in needed.items() if importlib.util.find_spec(module) is None))
PYEOF
)
    if [ -n "$missing" ]; then
        echo "missing: $missing; installing from $WHEELS"
        ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "no wheels in $WHEELS: carry them (see this script's header)"; return 1; }
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHEELS"/*.whl || return 1
    fi
    "$PY" - <<'PYEOF' || return 1
import cupy
major = int(cupy.__version__.split(".")[0])
assert major >= 14, f"CuPy {cupy.__version__}: before 14 a None kernel argument is a null address; install CuPy 14"
from duet.engine.backend.select import backend_name
assert backend_name("auto") == "cupy", "CuPy sees no GPU"
print("CuPy", cupy.__version__, "on", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
PYEOF
}

export PYTHONPATH="/tmp/duet-site${PYTHONPATH:+:$PYTHONPATH}"
unset DUET_BACKEND  # the GPU model is chosen because the GPU is there
cd "$repo"
pytest=("$PY" -m pytest -q -s -p no:cacheprovider)
export repo PY WHEELS
stage setup 60 bash -c "$(declare -f setup); setup" || { echo "setup failed: nothing else can run"; exit 1; }
stage compile 60 "${pytest[@]}" tests/engine/test_kernels_compile.py
stage kernels 90 "${pytest[@]}" tests/engine/test_gpu_kernels.py
stage model 120 "${pytest[@]}" tests/engine/test_gpu_model.py tests/app/test_bench_gpu.py
stage flash 60 "${pytest[@]}" tests/engine/test_gpu_flash_next.py
stage gemv 60 "$PY" -m duet.app.cli bench gpu --table gemv --repeats 10
stage cycle 90 "$PY" -m duet.app.cli bench gpu --table cycle --repeats 10
echo "== done in ${SECONDS}s; $summary:"
cat "$summary"
