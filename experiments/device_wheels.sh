#!/usr/bin/env bash
# Fills .whl/ (git-ignored through .git/info/exclude) with the CPython 3.12 manylinux x86-64
# wheels that experiments/device_check.sh installs on a lent NVIDIA H200, whose image has jax,
# flax, optax, orbax, torch, transformers, accelerate, peft, pyarrow, pandas, ... but not
# ml_collections, tensorflow-datasets (and the parts of its needs the image lacks) or TRL (and
# datasets, dill, multiprocess). That machine reaches no package registry: run this HERE, on a
# machine that does, then name ".whl" in the device call's `carry`.
#
#   bash experiments/device_wheels.sh        # from anywhere inside the checkout
#
# One version of each package (two stop the whole install there), so .whl/*.whl is cleared
# first. --no-deps: every package it needs that the image lacks is named below, and the check at
# the end lists any requirement that is neither here nor in the image's package list (as the
# device README recorded it, 2026-11-17). `promise` ships no wheel: it is built here (pure
# Python, py3-none-any). The versions are those of the project's CPU environment where it has
# them (ml_collections, tensorflow-datasets and its needs), TRL as setup.py's [peers] extra pins
# it, and a datasets release that asks for no newer pyarrow than TRL does (5.2.0 wants >= 24).
set -euo pipefail

ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
PY=${PYTHON:-}
if [[ -z $PY ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >>"$EXCLUDE"

WHEELS=(
  # rlx's own needs that the image lacks
  ml_collections==1.1.0
  tensorflow-datasets==4.9.10
  array_record==0.8.6
  dm-tree==0.1.10
  immutabledict==4.3.1
  simple-parsing==0.1.9
  docstring-parser==0.18.0          # simple-parsing's
  tensorflow-metadata==1.21.0
  googleapis-common-protos==1.76.0  # tensorflow-metadata's
  termcolor==3.3.0
  toml==0.10.2
  importlib_resources==7.1.0        # setup.py: tensorflow-datasets (etils) without tensorflow
  # experiments/benchmarks/bench_peers.py's peer
  trl==1.16.0
  datasets==5.0.1
  dill==0.4.1
  multiprocess==0.70.19
)
BUILT=(promise==2.3)  # no wheel on the registry: built from its sdist

mkdir -p .whl
rm -f .whl/*.whl
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}"
"$PY" -m pip wheel -q --no-deps -w .whl "${BUILT[@]}"

# One wheel per package, every one named above, and nothing the image's own packages or these
# wheels do not cover among their (non-extra) requirements for CPython 3.12 on Linux x86-64.
"$PY" - "${WHEELS[@]}" "${BUILT[@]}" <<'EOF'
import collections, glob, re, sys, zipfile
from packaging.markers import default_environment
from packaging.requirements import Requirement

def norm(name):
  return re.sub(r"[-_.]+", "-", name).lower()

# The image's Python packages ("cuda" image, read on 2026-11-17; the device README's KINDS.md).
IMAGE = set(map(norm, """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal
annotated-doc anyio attrs botorch build certifi charset-normalizer chex click cloudpickle cmake
colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x
cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub
humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson
ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless
optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark
pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml
regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq
torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp""".split()))

wanted = {norm(spec.split("==")[0]): spec.split("==")[1] for spec in sys.argv[1:]}
env = dict(default_environment(), python_version="3.12", python_full_version="3.12.3",
           implementation_name="cpython", platform_python_implementation="CPython",
           sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
           os_name="posix", extra="")
have, needs, problems = collections.defaultdict(list), {}, []
for path in sorted(glob.glob(".whl/*.whl")):
  with zipfile.ZipFile(path) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
  name = norm(re.search(r"^Name: (.+)$", text, re.M).group(1).strip())
  version = re.search(r"^Version: (.+)$", text, re.M).group(1).strip()
  have[name].append(version)
  for line in re.findall(r"^Requires-Dist: (.+)$", text, re.M):
    req = Requirement(line)
    if req.marker is None or req.marker.evaluate(env):
      needs.setdefault(norm(req.name), set()).add(name)
for name, versions in have.items():
  if len(versions) > 1:
    problems.append(f"{name}: {len(versions)} versions {versions} (keep one)")
  if name not in wanted:
    problems.append(f"{name} {versions}: not asked for")
for name, version in wanted.items():
  if have.get(name) != [version]:
    problems.append(f"{name}=={version}: no such wheel in .whl/ (found {have.get(name)})")
for name, by in sorted(needs.items()):
  if name not in have and name not in IMAGE:
    problems.append(f"{name}: needed by {sorted(by)}, neither in .whl/ nor in the image")
if problems:
  sys.exit("device_wheels: " + "\n  ".join(["problems:"] + problems))
print(f"device_wheels: {len(have)} wheels, one version each; every requirement is in .whl/ or "
      f"in the image's package list")
EOF

ls -1 .whl
du -ch .whl/*.whl | tail -1 | sed 's/total/.whl in all/'
echo "the tracked tree: $(git ls-files -z | du -ch --files0-from=- | tail -1 | cut -f1)"
echo "untracked, not ignored (travels too): $(git ls-files -z -o --exclude-standard | du -ch --files0-from=- 2>/dev/null | tail -1 | cut -f1)"
