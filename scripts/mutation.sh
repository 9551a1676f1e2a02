#!/usr/bin/env bash
# Mutation testing of the engine's core with mutmut (docs/TESTING.md has the score).
#   bash scripts/mutation.sh [MODULE_PATH TEST_FILE...]
# e.g. bash scripts/mutation.sh engine/speculative.py tests/engine/test_speculative_exact.py
# MUTANTS='duet.engine.checkpoint.hf.xǁTensorPlanǁ_plan_ple*' (mutmut's names, fnmatch globs) runs only
# the mutants of the functions a change touched.
# Installs into the venv: pip install -e ".[test,mutation]".
#
# mutmut names mutants after the file's path, and the tests import `duet.engine.*`, which the repo
# keeps in engine/ (setup.py maps it). So the run happens in a staging copy laid out as the import
# names say (duet/engine, duet/app, duet/models), where path and module name agree.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
module="${1:?which module to mutate, e.g. engine/speculative.py}"
shift
tests=("$@")
stage="${MUTATION_STAGE:-/tmp/duet-mutation}/$(basename "$module" .py)"
rm -rf "$stage" && mkdir -p "$stage/duet"
cp -r "$repo/engine" "$repo/app" "$repo/models" "$stage/duet/"
touch "$stage/duet/__init__.py"
cp -r "$repo/tests" "$stage/tests"
# Tests find the demo models at the repository root: the stage's, and mutmut's copy of it (mutants/).
mkdir -p "$stage/mutants" && ln -s duet/models "$stage/models" && ln -s duet/models "$stage/mutants/models"
find "$stage" -name __pycache__ -prune -exec rm -rf {} +
args=$(printf '"%s", ' "${tests[@]}")
cat >"$stage/pyproject.toml" <<TOML
[tool.pytest.ini_options]
pythonpath = ["."]
addopts = "-p no:cacheprovider"

[tool.mutmut]
source_paths = ["duet"]
only_mutate = ["duet/$module"]
pytest_add_cli_args_test_selection = [${args%, }]
process_isolation = "forkserver"
# A mutant's tests pay for their fixtures (model building) again; mutmut's limit is CPU seconds.
timeout_constant = 60.0
TOML
cd "$stage"
# mutmut forks each mutant's run from a process that has already run the tests once: a thread pool
# (torch's OpenMP, OpenBLAS) started before the fork is dead in the child, and the first parallel
# region waits on it forever (seen in transformers' forward). One thread each: no pool to inherit.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1
# mutmut redraws a progress line hundreds of times: keep it in a log, print the summary below.
# shellcheck disable=SC2086  # MUTANTS is a list of globs, split on purpose
mutmut run --max-children "${MUTATION_JOBS:-2}" ${MUTANTS:-} >"$stage/run.log" 2>&1 || true
mutmut results --all true >"$stage/results.txt" || true
python - "$stage/results.txt" <<'PY'
import collections, sys
counts = collections.Counter(line.rsplit(":", 1)[-1].strip() for line in open(sys.argv[1]) if ":" in line)
counts.pop("not checked", None)  # outside the MUTANTS asked for
killed = counts.get("killed", 0) + counts.get("timeout", 0)
total = sum(counts.values())
print(dict(counts), f"score {killed}/{total} = {killed / max(total, 1):.1%}")
PY
echo "log: $stage/run.log; survivors: cd $stage && mutmut results; mutmut show NAME"
