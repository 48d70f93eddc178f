#!/usr/bin/env bash
# The one-shot device check of issue 39: on a lent NVIDIA H200, from a bare machine, in at most
# ~8 minutes (DEVICE_CHECK_BUDGET_S, default 470 s, install included), each part under its own
# time cap, every result under $OUT:
#
#   tests      python -m pytest -q tests/kernels (the compiled Pallas kernels against the
#              reference on the GPU)                                          -> tests.log
#   kernels    benchmarks/bench_kernels.py (paged + cascade decode attention) -> kernels.log
#   peers100m  benchmarks/bench_peers.py --size=100m, rlx vs TRL's GRPOTrainer with TRL on
#              the GPU (--trl_device=cuda)                                    -> peers_100m.log
#   step       benchmarks/bench_step.py on experiments/reasoning.py (its warm start is trained
#              first, cached in the run's workdir)                            -> step_reasoning.log
#   peers05b   bench_peers at a 0.5B-class --size (300M-800M params), when bench_peers has one;
#              else recorded as not run. Last, so that its long compile cannot starve the rest
#                                                                             -> peers_05b.log
#   step100m   (off by default) bench_step on bench_peers' 100M workload with --sampler_compare
#              (paged vs dense in the loop); needs peers100m's model dir    -> step_100m.log
# plus env.log (machine, versions, the wheel install and an import check) and summary.md (one
# row per part: passed / failed / timed out / skipped, seconds, the lines that matter), written
# as each part ends, so a run cut short still leaves one. At most 8 files come back from $OUT.
#
# On the device (the wheels made here first: bash experiments/device_wheels.sh):
#   run(command="bash experiments/device_check.sh", carry=[".whl"], timeout_s=540)
# Here, to check the wiring (install skipped, the project's venv, tiny sizes, --quick,
# collection only; a few minutes of one CPU core):
#   DEVICE_CHECK_DRY=1 bash experiments/device_check.sh
#
# Knobs (environment): DEVICE_CHECK_PARTS="tests kernels peers100m step peers05b" (which parts,
# in that order), DEVICE_CHECK_BUDGET_S, CAP_<PART>_S (each part's cap, e.g. CAP_STEP_S=150),
# DEVICE_CHECK_PEERS_ARGS / DEVICE_CHECK_PEERS05B_ARGS / DEVICE_CHECK_STEP_ARGS (appended to
# that part's command), DEVICE_CHECK_05B_SIZE (bench_peers --size to use as the 0.5B class),
# DEVICE_CHECK_TORCH_TF32=0 (TRL in true f32; by default torch's f32 matmuls run as TF32, as
# JAX's do on this GPU), PYTHON (the interpreter).
#
# How rlx is made importable there: `pip install -e .` needs the network (build isolation), and
# the checkout's root must not be on sys.path (its top-level kernels/ would stand in for Hugging
# Face's `kernels` that transformers probes for, and TRL fails to import). So rlx/ is copied into
# a folder of its own with kernels/ and experiments/ copied in as rlx/kernels and
# rlx/experiments (what setup.py's package_dir installs), that folder goes on PYTHONPATH, and the
# benchmarks run as `python -m rlx.experiments.NAME` from inside it. The kernel tests run from a
# second copy laid out as the checkout (rlx, kernels, tests, pytest.ini; tests/kernels checks
# that layout), where no transformers is imported.
set -uo pipefail

T0=$SECONDS
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DRY=${DEVICE_CHECK_DRY:-0}
BUDGET=${DEVICE_CHECK_BUDGET_S:-470}
PARTS=${DEVICE_CHECK_PARTS:-tests kernels peers100m step peers05b}
RESERVE=8   # seconds kept for the summary
MIN_PART=20 # a part with less left than this is skipped

if [[ $DRY == 1 ]]; then
  PY=${PYTHON:-$REPO/.venv/bin/python}
  [[ -x $PY ]] || PY=python3
  OUT=${OUT:-$(mktemp -d /tmp/device_check_out.XXXXXX)}
  SCRATCH=$(mktemp -d /tmp/device_check.XXXXXX)
else
  PY=${PYTHON:-python3}
  OUT=${OUT:-/tmp/device_check_out}
  SCRATCH=/tmp/device_check
  rm -rf "$SCRATCH"
fi
PY=$(command -v "$PY")
mkdir -p "$OUT" "$SCRATCH"
SUMMARY=$OUT/summary.md
ENVLOG=$OUT/env.log

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Nothing outside the device can be reached: no hub look-ups (they would wait for a timeout).
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export HF_HOME=$SCRATCH/hf MPLCONFIGDIR=$SCRATCH/mpl

say() { echo "[device_check $((SECONDS - T0))s] $*"; }

# ------------------------------------------------------------------ wheels, then rlx's copies
{
  echo "# device_check $(date -u +%FT%TZ), dry=$DRY, budget ${BUDGET}s, parts: $PARTS"
  echo "checkout: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git here')" \
       "($(git -C "$REPO" status --short 2>/dev/null | wc -l) paths differ from it)"
  echo "host: $(uname -srm), $(nproc) CPUs; python: $PY ($("$PY" -V 2>&1))"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem \
    --format=csv,noheader 2>&1 || echo "nvidia-smi: none"
} >"$ENVLOG" 2>&1

SITE=""
if [[ $DRY == 1 ]]; then
  echo "dry run: no wheel install; the interpreter's own packages" >>"$ENVLOG"
elif compgen -G "$REPO/.whl/*.whl" >/dev/null; then
  SITE=/tmp/site
  say "installing $(ls "$REPO"/.whl/*.whl | wc -l) carried wheels into $SITE"
  # As the device README says; --upgrade replaces what an earlier run left there.
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
       --target "$SITE" "$REPO"/.whl/*.whl >>"$ENVLOG" 2>&1; then
    echo "wheels installed into $SITE: $(cd "$REPO/.whl" && ls *.whl | tr '\n' ' ')" >>"$ENVLOG"
  else
    echo "WHEEL INSTALL FAILED (see above); going on without them" >>"$ENVLOG"
    SITE=""
  fi
else
  echo "NO .whl/ (run experiments/device_wheels.sh here and carry .whl): ml_collections," \
       "tensorflow-datasets and TRL are missing, so every part but tests/kernels fails" >>"$ENVLOG"
fi

STAGE=$SCRATCH/stage
PKG=$STAGE/pkg   # holds only rlx: the PYTHONPATH entry and the benchmarks' working directory
SRC=$STAGE/src   # the checkout's layout, for the kernel tests
mkdir -p "$PKG" "$SRC"
cp -r "$REPO/rlx" "$PKG/rlx"
[[ -e $PKG/rlx/kernels ]] || cp -r "$REPO/kernels" "$PKG/rlx/kernels"
[[ -e $PKG/rlx/experiments ]] || cp -r "$REPO/experiments" "$PKG/rlx/experiments"
rm -rf "$PKG/rlx/experiments/results"  # notes, not code
cp -r "$REPO/kernels" "$REPO/tests" "$REPO/pytest.ini" "$SRC/"
ln -s "$PKG/rlx" "$SRC/rlx"
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
export PYTHONPATH=${SITE:+$SITE:}$PKG${PYTHONPATH:+:$PYTHONPATH}

{
  echo "PYTHONPATH=$PYTHONPATH"
  (cd "$PKG" && "$PY" - <<'EOF'
import importlib, importlib.metadata as md, importlib.util, os
for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "torch",
             "transformers", "accelerate", "huggingface-hub", "tokenizers", "safetensors",
             "pyarrow", "fsspec", "protobuf", "etils", "ml_collections", "tensorflow-datasets",
             "trl", "datasets", "dill", "multiprocess"):
  try:
    v = md.version(name)
  except md.PackageNotFoundError:
    v = "MISSING"
  print(f"  {name} {v}")
for mod in ("rlx", "rlx.kernels", "rlx.experiments.benchmarks.bench_peers", "ml_collections",
            "tensorflow_datasets", "trl", "datasets"):
  try:
    m = importlib.import_module(mod)
    print(f"import {mod}: ok ({os.path.dirname(m.__file__)})")
  except Exception as e:  # pylint: disable=broad-except
    print(f"import {mod}: FAILED {type(e).__name__}: {e}")
spec = importlib.util.find_spec("kernels")
print("top-level kernels:", "none (as it must be: the checkout's kernels/ is not on sys.path)"
      if spec is None else spec.origin)
import jax
print("jax devices:", jax.devices())
EOF
  )
} >>"$ENVLOG" 2>&1
say "staged rlx in $PKG; versions and imports in $ENVLOG"

# ------------------------------------------------------------------ the parts
{
  echo "# device_check summary ($(date -u +%F), dry=$DRY, budget ${BUDGET}s)"
  echo
  grep -m1 -E "^NVIDIA|nvidia-smi: none" "$ENVLOG" || true
  grep -E "^  (jax|torch|transformers|trl|datasets|pyarrow|huggingface-hub) " "$ENVLOG" | tr '\n' ';'
  echo
  grep -E "FAILED|MISSING|NO .whl" "$ENVLOG" || true
  echo
  echo "| part | status | seconds | cap s | log |"
  echo "|---|---|---|---|---|"
} >"$SUMMARY"
declare -a NOTES=()

# run_part NAME CAP LOG DIR PATTERN CMD: CMD (a bash command line) in DIR under `timeout` (its
# whole process group: bench_peers' workers too), output to $OUT/LOG; the log's lines matching
# the extended regex PATTERN go into the summary.
run_part() {
  local name=$1 cap=$2 log=$3 dir=$4 pattern=$5 cmd=$6
  local left=$((BUDGET - (SECONDS - T0) - RESERVE))
  if ((left < MIN_PART)); then
    echo "| $name | skipped: ${left}s left of the budget | 0 | $cap | - |" >>"$SUMMARY"
    say "$name: skipped (${left}s left)"
    return
  fi
  ((cap > left)) && cap=$left
  say "$name: up to ${cap}s: $cmd"
  local t=$SECONDS rc status
  printf '# %s (cap %ss, from %s)\n$ cd %s && %s\n' "$name" "$cap" "$(date -u +%T)" "$dir" \
    "$cmd" >"$OUT/$log"
  (cd "$dir" && timeout -k 15 "$cap" bash -c "$cmd") >>"$OUT/$log" 2>&1
  rc=$?
  case $rc in
    0) status=passed ;;
    124 | 137) status="TIMED OUT" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  echo "# exit $rc after $((SECONDS - t)) s" >>"$OUT/$log"
  echo "| $name | $status | $((SECONDS - t)) | $cap | $log |" >>"$SUMMARY"
  NOTES+=("### $name ($status)" "$(grep -E "$pattern" "$OUT/$log" | tail -n 40)" "")
  say "$name: $status in $((SECONDS - t))s"
}

skip_part() {  # NAME WHY
  echo "| $1 | not run: $2 | 0 | - | - |" >>"$SUMMARY"
  say "$1: not run: $2"
}

cap() { local v="CAP_${1}_S"; echo "${!v:-$2}"; }

TF32=${DEVICE_CHECK_TORCH_TF32:-1}
PEERS_ENV="XLA_PYTHON_CLIENT_PREALLOCATE=false"  # JAX and torch share the GPU in one run
[[ $TF32 == 1 ]] && PEERS_ENV+=" TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1"
if [[ $DRY == 1 ]]; then
  if (cd "$PKG" && "$PY" -c "import trl, datasets" >/dev/null 2>&1); then
    PEERS_WHO="--peers=trl --trl_device=cpu"
  else
    PEERS_WHO="--rlx_only"  # no TRL in this interpreter: rlx's side only
  fi
else
  PEERS_WHO="--peers=trl --trl_device=cuda"
fi

for part in $PARTS; do
  case $part in
    tests)
      if [[ $DRY == 1 ]]; then
        cmd="$PY -m pytest -q tests/kernels/test_import_name.py && $PY -m pytest -q --collect-only tests/kernels | tail -n 3"
      else
        cmd="$PY -m pytest -q -rs tests/kernels"
      fi
      run_part tests "$(cap TESTS 80)" tests.log "$SRC" \
        "passed|failed|error|Error|skipped|SKIPPED|tests? collected" "$cmd" ;;
    kernels)
      if [[ $DRY == 1 ]]; then q="--quick --repeats=1 --skip_cascade"; else q=""; fi
      run_part kernels "$(cap KERNELS 100)" kernels.log "$PKG" \
        "^device:|^\| |rows ok|Error" \
        "$PY -m rlx.experiments.benchmarks.bench_kernels $q --out=$SCRATCH/kernels.md; rc=\$?; cat $SCRATCH/kernels.md 2>/dev/null; exit \$rc" ;;
    peers100m)
      if [[ $DRY == 1 ]]; then size="--size=tiny --steps=1 --warmup=0"; else size="--size=100m --steps=5 --warmup=1"; fi
      run_part peers100m "$(cap PEERS100M 150)" peers_100m.log "$PKG" \
        "^model:|TRL on|^\| |^Medians|Error|error:" \
        "$PEERS_ENV $PY -m rlx.experiments.benchmarks.bench_peers $size $PEERS_WHO --workdir=$SCRATCH/p100 ${DEVICE_CHECK_PEERS_ARGS:-}" ;;
    peers05b)
      size=${DEVICE_CHECK_05B_SIZE:-$(cd "$PKG" && "$PY" - 2>>"$ENVLOG" <<'EOF'
from rlx.experiments.benchmarks import bench_peers as b
sizes = sorted((abs(m.num_params() - 5e8), k) for k, m in b.MODELS.items()
               if 3e8 <= m.num_params() <= 8e8)
print(sizes[0][1] if sizes else "")
EOF
)}
      if [[ -z $size ]]; then
        sizes=$(cd "$PKG" && "$PY" -c "from rlx.experiments.benchmarks import bench_peers as b; print(', '.join(f'{k} ({m.num_params() / 1e6:.0f}M)' for k, m in b.MODELS.items()))" 2>>"$ENVLOG")
        skip_part peers05b "bench_peers has no 0.5B-class --size (it has: ${sizes:-?})"
      elif [[ $DRY == 1 ]]; then
        run_part peers05b "$(cap PEERS05B 60)" peers_05b.log "$PKG" "size|0.5|error" \
          "$PY -m rlx.experiments.benchmarks.bench_peers --help | grep -A2 -- --size; echo 'would run --size=$size'"
      else
        run_part peers05b "$(cap PEERS05B 180)" peers_05b.log "$PKG" \
          "^model:|TRL on|^\| |^Medians|Error|error:" \
          "$PEERS_ENV $PY -m rlx.experiments.benchmarks.bench_peers --size=$size --steps=2 --warmup=1 $PEERS_WHO --workdir=$SCRATCH/p05b ${DEVICE_CHECK_PEERS05B_ARGS:-}"
      fi ;;
    step)
      if [[ $DRY == 1 ]]; then
        a="--config=$PKG/rlx/experiments/reasoning.py:runlocal --config.sft.steps=2 --steps=1 --eval=false --phases=false"
      else
        a="--config=$PKG/rlx/experiments/reasoning.py --steps=5"
      fi
      run_part step "$(cap STEP 120)" step_reasoning.log "$PKG" \
        "^config:|^machine|^phase|^generation|^sampler|^update|^step|^evaluation|tokens/s|generation share|^steps|Error|error:" \
        "$PY -m rlx.experiments.benchmarks.bench_step $a --workdir=$SCRATCH/reasoning ${DEVICE_CHECK_STEP_ARGS:-}" ;;
    step100m)
      if [[ ! -f $SCRATCH/p100/model/config.json ]]; then
        skip_part step100m "no bench_peers model dir ($SCRATCH/p100): run peers100m first"
        continue
      fi
      if [[ $DRY == 1 ]]; then a="--steps=1 --phases=false"; else a="--steps=3 --sampler_compare"; fi
      run_part step100m "$(cap STEP100M 150)" step_100m.log "$PKG" \
        "^config:|^machine|^phase|^generation|^sampler|^update|^step|^paged|^dense|tokens/s|generation share|^steps|Error|error:" \
        "$PY -m rlx.experiments.benchmarks.bench_step --config=$PKG/rlx/experiments/benchmarks/bench_peers_config.py:$SCRATCH/p100 --workdir=$SCRATCH/p100/step --eval=false $a" ;;
    *)
      skip_part "$part" "unknown part (known: tests kernels peers100m step peers05b step100m)" ;;
  esac
done

{
  echo
  echo "Total $((SECONDS - T0)) s of a ${BUDGET} s budget. TRL: $PEERS_WHO" \
       "(torch TF32 override $TF32, XLA_PYTHON_CLIENT_PREALLOCATE=false in the peers parts)."
  echo
  printf '%s\n' "${NOTES[@]}"
} >>"$SUMMARY"
echo
cat "$SUMMARY"
echo
say "logs: $(cd "$OUT" && ls | tr '\n' ' ')in $OUT"
