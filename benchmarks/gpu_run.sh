#!/usr/bin/env bash
# bik on a GPU machine, in steps that each end inside a 10-minute command and can run as
# separate commands. Needs a CUDA build of torch, Triton, transformers, pytest and hypothesis
# installed (pybind11, setuptools and nvcc to build); installs nothing from the network.
#
#   bash benchmarks/gpu_run.sh env                 versions, GPU, nvcc (seconds)
#   bash benchmarks/gpu_run.sh build               install bik with its C++ and CUDA backends
#   bash benchmarks/gpu_run.sh test [PART] [-- PYTEST ARGS]
#        PART: all (default; the whole suite), kernels (tests/ops, layers, backends), models
#        (tests/integrations: hf, mode, vllm, distributed), rl (tests/rl, tests/tools);
#        after `--`, pytest arguments: with a PART, added to its files
#        (`test kernels -- -m "not slow"`), without one, in place of them
#        (`test -- tests/backends/test_gpu.py -k decode`); `files PART` lists a part's files
#   bash benchmarks/gpu_run.sh bench GROUP [BENCH ARGS]
#        GROUP: matmul (linear, the TP-invariant tp_linear), attention (decode, prefill, paged decode), rows (rms_norm,
#        log_softmax, token_logprobs), e2e (patched models: Qwen3-style, SmolLM2-135M's
#        shapes, MoE), quick (every op, small), all (long);
#        BENCH ARGS go to `python -m bik bench` (e.g. --min-time 0.1)
#
#   bash benchmarks/gpu_run.sh probe [PROBE ARGS]
#        benchmarks/gpu_probe.py for the step's time (host cost, the bucket table and
#        candidates against cuBLAS, attention, patched decode); PROBE ARGS go to it
#        (e.g. --parts host,table); no build needed (the Triton kernels only)
#
#   bash benchmarks/gpu_run.sh anatomy [ANATOMY ARGS]
#        benchmarks/gpu_anatomy.py on the real model: where a native engine's mismatch comes
#        from (engine batch 1/8/64, decode vs prefill, fp16, an fp32 head, top-p renormalised);
#        needs the model unpacked first (`python -m bik model smollm2 --unpack DIR`,
#        docs/models.md); ANATOMY ARGS go to it (e.g. --top-p 0.9)
#
#   bash benchmarks/gpu_run.sh lease [SECONDS]
#        a short GPU loan in one command of SECONDS (default 540): build, the fast invariance
#        suite (kernels, then models), the quick bench in bf16 and fp32, then the whole bench
#        in bf16 for the time left; every step bounded, and all outputs packed after each step
#        into one archive, <gpu>-lease-<date>.tar.gz (for loans that return few files)
#
#   bash benchmarks/gpu_run.sh rehearse STEP [ARGS]
#        STEP as above, on a machine without a GPU: everything up to the first thing that
#        needs one (the build, the backends' import, pytest's collection, the bench's argument
#        parsing), then it stops with a message naming that thing (exit status 0). Outputs are
#        named rehearsal-<what>-<date>. With PYTHON set to another environment (e.g.
#        .venv-gpu-image/bin/python, the GPU image's Triton and transformers) it rehearses
#        that one.
#
# Every step but env builds bik first when this tree is not built yet (a fresh machine), in
# the same time budget. Run one step per command: each stops itself after BIK_STEP_SECONDS
# (default 540) counted from its start, keeping what it has (pytest's summary and JUnit XML,
# the bench records so far), so a 10-minute command limit is never hit.
#
# Outputs, in ${OUT:-benchmarks/results} (at most 5 files per step, the build log included), named <gpu>-<what>-<date>:
#   env:   <gpu>-env-<date>.txt
#   build: <gpu>-build-<date>.log (pip's full output, then which backends load)
#   test:  <gpu>-test-<part>-<date>.{log,xml} (the pytest log with a failure/skip summary and
#          the slowest tests; JUnit XML of every test)
#   probe: <gpu>-probe-<date>/probe.{jsonl,md} and <gpu>-probe-<date>.log
#   bench: <gpu>-<group>-<date>.{json,md,png,log} (with BIK_BACKEND=cuda:
#          <gpu>-<group>-cuda-<date>.*, the portable reference backend)
# The bench JSON and markdown record the torch, Triton and CUDA versions, the GPU's L2 size
# and SM count, and the peaks (torch matmul TFLOP/s, copy GB/s) measured in the same run.
#
# Environment: PYTHON (default python3), OUT, BIK_STEP_SECONDS, BIK_TEST_WORKERS (pytest-xdist
# workers when xdist is installed, default 4, 0 = none), BIK_TEST_TIMEOUT (seconds per test
# when pytest-timeout is installed, default 300), BIK_BENCH_DTYPES (default
# "bfloat16 float32"), BIK_BACKEND (bench another backend than the default, e.g. cuda),
# BIK_EXAMPLES (hypothesis examples per property test, default 25), BIK_OFFLINE (default 1: the
# GPU image has no network, so the tests and bench cases of a registry model skip, saying so,
# unless the model is already prepared in $BIK_CACHE; 0 to fetch it). The fast pass of the whole
# suite (`make test-fast`): BIK_EXAMPLES=5 bash benchmarks/gpu_run.sh test -- -m "not slow" tests
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-benchmarks/results}
STEP_SECONDS=${BIK_STEP_SECONDS:-540}
START=$(date +%s)
DATE=$(date +%F)
STAMP=build/gpu_run.stamp
REHEARSE=0 # 1: the `rehearse` step, on a machine that may have no GPU
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" # this tree's bik, in every subprocess too
unset TRITON_INTERPRET # the Triton kernels must compile for the GPU, not run interpreted
export BIK_OFFLINE=${BIK_OFFLINE:-1} # bik.testing.models: no registry download (see above)

die() {
  echo "gpu_run.sh: $*" >&2
  exit 1
}

usage() {
  sed -n '2,/^set -uo/p' "$ROOT/benchmarks/gpu_run.sh" | sed '$d' | sed 's/^# \{0,1\}//'
  exit "${1:-0}"
}

# nvcc is often installed off the PATH (setup.py calls it by name)
if ! command -v nvcc >/dev/null; then
  for dir in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    if [ -x "$dir/nvcc" ]; then
      export PATH="$dir:$PATH"
      break
    fi
  done
fi

remaining() { echo $((STEP_SECONDS - ($(date +%s) - START))); }

need_gpu() { # sets TAG, the GPU's name for file names (nvidia-h100-80gb-hbm3), or exits
  local rc
  TAG=$("$PY" -c "
import re, sys, torch
if not torch.cuda.is_available():
    print(f'torch {torch.__version__} sees no CUDA device', file=sys.stderr)
    sys.exit(3)
print(re.sub(r'[^a-z0-9._-]+', '-', torch.cuda.get_device_name().lower()).strip('-'))
")
  rc=$?
  if [ $rc = 3 ] && [ "$REHEARSE" = 1 ]; then
    TAG=rehearsal
    echo "gpu_run.sh: rehearsal without a GPU: up to the first thing that needs one"
  elif [ $rc != 0 ]; then
    die "no usable CUDA device for $PY"
  fi
  [ -n "$TAG" ] || die "no GPU name from $PY"
  mkdir -p "$OUT_DIR" build
}

# In a rehearsal without a GPU, the step ends here, successfully: all before it worked.
gpu_point() { # $1: what needs the GPU; $2: a log to note it in (optional)
  [ "$TAG" = rehearsal ] || return 0
  echo "gpu_run.sh: rehearsal: stops here: $1 needs a CUDA device" | tee -a "${2:-/dev/null}"
  exit 0
}

source_hash() {
  { echo "$PY $("$PY" -c 'import sys; print(sys.executable)')"; cat setup.py pyproject.toml \
    $(find csrc -type f | sort); } | sha256sum | cut -d' ' -f1
}

report_env() {
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(uname -a)"
  echo "cpus: $(nproc)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
      --format=csv 2>&1
  else
    echo "nvidia-smi: not found"
  fi
  echo "nvcc: $(command -v nvcc || echo 'not found')"
  command -v nvcc >/dev/null && nvcc --version | tail -2
  "$PY" - <<'EOF'
import importlib.metadata
import sys

import torch

print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    l2 = getattr(p, "L2_cache_size", 0)
    print(
        f"gpu {p.name}: capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
        f"{p.total_memory / 2**30:.1f} GiB, L2 {l2 / 2**20:.1f} MiB"
    )
for name in ("triton", "transformers", "numpy", "pybind11", "setuptools", "pytest",
             "hypothesis", "pytest-xdist", "pytest-timeout", "matplotlib", "vllm"):
    try:
        print(name, importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        print(name, "not installed")
EOF
}

# Which backends load and what "auto" picks on the GPU, plus one call of each GPU backend (in a
# rehearsal without a GPU: the GPU backends' modules and extensions load, nothing more).
check_backends() {
  "$PY" - "$TAG" <<'EOF'
import os
import sys

import torch

import bik
from bik import backends

here = os.path.dirname(bik.__file__)
print("bik", bik.__version__, "from", here)
ok = here == os.path.join(os.getcwd(), "bik")
rehearsal = sys.argv[1] == "rehearsal"
for name, device in (("cpu", "cpu"), ("triton", "cuda"), ("cuda", "cuda")):
    try:
        backend = backends.load(name)
        if rehearsal and device == "cuda":
            print(f"backend {name}: loads (running it needs a CUDA device)")
            continue
        backend.check_device(torch.device(device))
        x = torch.randn(3, 64, device=device)
        w = torch.randn(16, 64, device=device)
        with bik.use_backend(name):
            bik.linear(x, w), bik.rms_norm(x, torch.ones(64, device=device))
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"backend {name}: loads and runs on {device}")
    except Exception as error:  # report every backend, then fail
        print(f"backend {name}: FAILED: {type(error).__name__}: {error}")
        ok = False
if not rehearsal:
    print("auto on cuda ->", backends.resolve(torch.device("cuda")).name)
sys.exit(0 if ok else 1)
EOF
}

do_build() { # $1: log file
  local log=$1 rc
  {
    report_env
    echo
    echo "== BIK_BUILD_CUDA=1 BIK_REQUIRE_CPU=1 pip install --no-index --no-build-isolation --no-deps -e ."
  } >"$log" 2>&1
  rm -f "$STAMP"
  BIK_BUILD_CUDA=1 BIK_REQUIRE_CPU=1 "$PY" -m pip install -v --no-index --no-build-isolation \
    --no-deps -e . >>"$log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then # e.g. a read-only environment: build in place (PYTHONPATH finds it)
    tail -5 "$log"
    echo "== pip failed (rc $rc): BIK_BUILD_CUDA=1 BIK_REQUIRE_CPU=1 setup.py build_ext --inplace" |
      tee -a "$log"
    BIK_BUILD_CUDA=1 BIK_REQUIRE_CPU=1 "$PY" setup.py build_ext --inplace >>"$log" 2>&1
    rc=$?
  fi
  grep -E "WARNING: bik|error:" "$log" | tail -20
  if [ $rc -ne 0 ]; then
    tail -30 "$log"
    die "the build failed (rc $rc); see $log"
  fi
  echo "== backends" >>"$log"
  check_backends 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  source_hash >"$STAMP" # bik is installed (the cpu backend at least): later steps reuse it
  return "$rc"
}

ensure_built() { # build unless this tree, as it is now, is already installed
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(source_hash)" ] &&
    "$PY" -c "import os, bik, bik._cpu; assert os.path.dirname(bik.__file__) == '$ROOT/bik'" \
      2>/dev/null; then
    return 0
  fi
  echo "gpu_run.sh: building bik first ($TAG-build-$DATE.log)"
  do_build "$OUT_DIR/$TAG-build-$DATE.log" ||
    echo "gpu_run.sh: WARNING: not every backend loads (see the build log); going on" >&2
}

test_files() { # the test files of a part, by folder (tests/README.md maps them)
  local part=$1 dirs
  case "$part" in
  all) dirs="ops layers backends integrations tools rl" ;;
  kernels) dirs="ops layers backends" ;;
  models) dirs="integrations" ;;
  rl) dirs="rl tools" ;;
  esac
  for dir in $dirs; do
    ls tests/"$dir"/test_*.py
  done
}

step_test() {
  local part=all named=0 args=() name rc budget
  if [ $# -gt 0 ] && [ "$1" != "--" ]; then
    part=$1
    named=1
    shift
  fi
  case "$part" in all | kernels | models | rl) ;; *) die "test: unknown part '$part'" ;; esac
  [ $# -eq 0 ] || [ "$1" = "--" ] || die "test: expected -- before pytest arguments, got '$1'"
  [ $# -eq 0 ] || shift
  if [ $# -gt 0 ] && [ "$named" = 0 ]; then # pytest arguments alone: they name the tests
    args=("$@")
    part=custom
  else # a part's files, with the pytest arguments (e.g. -m "not slow") before them
    mapfile -t args < <(test_files "$part")
    args=("$@" "${args[@]}")
  fi
  need_gpu
  ensure_built
  name="$OUT_DIR/$TAG-test-$part-$DATE"
  local opts=(-rfEs --durations=30 -p no:cacheprovider --junitxml="$name.xml")
  if [ "${BIK_TEST_WORKERS:-4}" != 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
    opts+=(-n "${BIK_TEST_WORKERS:-4}" --dist loadfile)
  fi
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    opts+=(--timeout "${BIK_TEST_TIMEOUT:-300}")
  fi
  if [ "$TAG" = rehearsal ]; then # every test file imports, every argument is pytest's
    "$PY" -m pytest --collect-only -q -p no:cacheprovider "${args[@]}" 2>&1 | tail -3 |
      tee "$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || die "test: pytest could not collect the tests (exit status $rc)"
    gpu_point "running the tests" "$name.log"
  fi
  budget=$(remaining)
  [ "$budget" -gt 60 ] || die "test: only ${budget}s left of BIK_STEP_SECONDS=$STEP_SECONDS"
  echo "gpu_run.sh: pytest ${opts[*]} (${#args[@]} paths), stops after ${budget}s"
  timeout -s INT -k 20 "$budget" "$PY" -m pytest "${opts[@]}" "${args[@]}" 2>&1 | tee "$name.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ]; then
    echo "gpu_run.sh: pytest stopped at the step's time limit: the tests after the last" \
      "reported one did not run (split the part, or raise BIK_STEP_SECONDS)" | tee -a "$name.log"
  fi
  echo "wrote $name.log $name.xml (pytest exit status $rc)"
  return "$rc"
}

step_probe() {
  need_gpu
  local name="$OUT_DIR/$TAG-probe-$DATE" budget extra=()
  [ "$REHEARSE" = 1 ] && extra=(--rehearse) # no GPU: sm_90a compiles, the interpreter
  budget=$(remaining)
  [ "$budget" -gt 60 ] || die "probe: only ${budget}s left of BIK_STEP_SECONDS=$STEP_SECONDS"
  echo "gpu_run.sh: probe, its parts within $((budget - 30))s"
  timeout -k 20 "$budget" "$PY" benchmarks/gpu_probe.py --budget $((budget - 30)) \
    --out "$name" "${extra[@]}" "$@" 2>&1 | tee "$name.log"
  echo "wrote $name/probe.{jsonl,md} and $name.log (probe exit status ${PIPESTATUS[0]})"
}

step_anatomy() {
  need_gpu
  local name="$OUT_DIR/$TAG-anatomy-$DATE" budget
  gpu_point "benchmarks/gpu_anatomy.py --device cuda" # rehearse it on a CPU with --device cpu
  ensure_built
  budget=$(remaining)
  timeout -k 20 "$budget" "$PY" benchmarks/gpu_anatomy.py --device cuda --out "$name" "$@" \
    2>&1 | tee "$name.log"
  echo "wrote $name/gpu_anatomy.{json,md} and $name.log (exit status ${PIPESTATUS[0]})"
}

step_bench() {
  [ $# -gt 0 ] || die "bench: expected a group: matmul, attention, rows, e2e, quick or all"
  local group=$1 ops=() extra=()
  shift
  case "$group" in
  matmul) ops=(linear tp_linear) ;;
  attention) ops=(attention_decode attention_prefill attention_paged_decode) ;;
  rows) ops=(rms_norm log_softmax token_logprobs) ;;
  e2e) ops=(e2e_forward e2e_decode e2e_hybrid_decode moe_block e2e_moe_forward) ;;
  quick) extra=(--quick) ;;
  all) ;;
  *) die "bench: unknown group '$group'; expected matmul, attention, rows, e2e, quick or all" ;;
  esac
  need_gpu
  ensure_built
  local name rc budget suffix=""
  if [ -n "${BIK_BACKEND:-}" ] && [ "$BIK_BACKEND" != auto ]; then
    suffix="-$BIK_BACKEND"
  fi
  name="$OUT_DIR/$TAG-$group$suffix-$DATE"
  [ ${#ops[@]} -gt 0 ] && extra+=(--ops "${ops[@]}")
  if "$PY" -c "import matplotlib" 2>/dev/null; then
    extra+=(--plot "$name.png")
  else
    echo "gpu_run.sh: matplotlib is not installed: no plot"
  fi
  read -r -a dtypes <<<"${BIK_BENCH_DTYPES:-bfloat16 float32}"
  budget=$(remaining)
  [ "$budget" -gt 60 ] || die "bench: only ${budget}s left of BIK_STEP_SECONDS=$STEP_SECONDS"
  echo "gpu_run.sh: bench $group, stops after ${budget}s"
  timeout -s INT -k 20 "$budget" "$PY" -m bik bench --device cuda --dtypes "${dtypes[@]}" \
    "${extra[@]}" --json "$name.json" --markdown "$name.md" "$@" 2>&1 |
    tee "$name.log"
  rc=${PIPESTATUS[0]}
  if [ "$TAG" = rehearsal ] && [ "$rc" = 2 ] &&
    grep -q "argument --device: cuda requested" "$name.log"; then
    gpu_point "bik bench (its arguments parsed; it refused --device cuda)" "$name.log"
  fi
  echo "wrote $name.{json,md,png,log} (bench exit status $rc: 0 ok, 1 a case failed," \
    "124/130 stopped at the time limit with the records so far)"
  return "$rc"
}

step_lease() {
  local total=${1:-540} deadline dir archive
  [[ "$total" =~ ^[0-9]+$ ]] || die "lease: expected a number of seconds, got '$total'"
  need_gpu
  local rehearse=() # in a rehearsal, each step rehearses in turn
  [ "$TAG" = rehearsal ] && rehearse=(rehearse)
  deadline=$((START + total))
  dir=$ROOT/build/lease
  archive="$OUT_DIR/$TAG-lease-$DATE.tar.gz"
  rm -rf "$dir"
  mkdir -p "$dir"
  export BIK_TEST_WORKERS=${BIK_TEST_WORKERS:-8} BIK_TEST_TIMEOUT=${BIK_TEST_TIMEOUT:-120}
  lease_part() { # $1: seconds at most (less if the lease ends sooner); then a step and its args
    local cap=$1 left
    shift
    left=$((deadline - $(date +%s)))
    [ "$cap" -le "$left" ] || cap=$left
    if [ "$cap" -lt 75 ]; then # a step refuses to start on 60 s or less
      echo "== lease: ${left}s left: $* skipped"
      return
    fi
    echo "== lease: $* (at most ${cap}s)"
    OUT=$dir BIK_STEP_SECONDS=$cap bash "$ROOT/benchmarks/gpu_run.sh" "${rehearse[@]}" "$@"
    echo "== lease: $* ended with exit status $?"
    tar -czf "$archive" -C "$dir" .
  }
  lease_part 180 build
  BIK_EXAMPLES=5 lease_part 150 test kernels -- -m "not slow"
  BIK_EXAMPLES=5 lease_part 90 test models -- -m "not slow"
  BIK_BENCH_DTYPES="bfloat16 float32" lease_part 80 bench quick --min-time 0.1
  BIK_BENCH_DTYPES=bfloat16 lease_part "$total" bench all --min-time 0.05
  echo "== lease: summary (all outputs in $archive)"
  grep -hE "^(FAILED|ERROR) |[0-9]+ (passed|failed)|^backend .*:" "$dir"/*.log | head -60
  cat "$dir"/*-quick-*.md 2>/dev/null
  return 0
}

main() {
  [ $# -gt 0 ] || usage 2
  step=$1
  shift
  case "$step" in
  -h | --help | help) usage 0 ;;
  env)
    need_gpu
    report_env 2>&1 | tee "$OUT_DIR/$TAG-env-$DATE.txt"
    ;;
  build)
    [ $# -eq 0 ] || die "build takes no arguments"
    need_gpu
    do_build "$OUT_DIR/$TAG-build-$DATE.log"
    rc=$?
    echo "wrote $OUT_DIR/$TAG-build-$DATE.log"
    [ "$rc" != 0 ] ||
      gpu_point "running the triton and cuda backends" "$OUT_DIR/$TAG-build-$DATE.log"
    exit "$rc"
    ;;
  files) # the test files of a part, one a line (no GPU needed)
    [ $# -eq 1 ] || die "files: expected one part: all, kernels, models or rl"
    case "$1" in all | kernels | models | rl) test_files "$1" ;; *) die "files: unknown part '$1'" ;; esac
    ;;
  test) step_test "$@" ;;
  lease) step_lease "$@" ;;
  bench) step_bench "$@" ;;
  probe) step_probe "$@" ;;
  anatomy) step_anatomy "$@" ;;
  rehearse)
    [ $# -gt 0 ] && [ "$1" != rehearse ] ||
      die "rehearse: expected a step: env, build, test, bench, probe, anatomy or lease"
    REHEARSE=1
    main "$@"
    ;;
  *)
    echo "gpu_run.sh: unknown step '$step'" >&2
    usage 2
    ;;
  esac
}

# sourced (tests): the functions only
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
