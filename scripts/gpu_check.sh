#!/usr/bin/env bash
# GPU verification on a machine without network: build, GPU tests, compute-sanitizer, benchmarks.
#
#   scripts/gpu_check.sh OUTDIR [build] [perf | perf:PART,PART ...] [test | test:PATH ...] [sanitize]
#                               [racecheck] [bench | bench:OP ...] [tune]
#   (default: build sanitize test bench, in order; a speed run is `build perf`, or `build perf:host,layer`)
#
# `perf` runs `python -m bench.perf` (bench/perf.py): the parts env, host, gemm, layer, fp8, permute,
# dispatch, step and hf in priority order within PERF_BUDGET seconds (default 360, about 6 minutes after the
# build), each family's JSON written to OUTDIR as it ends, so a run cut short keeps what it measured;
# `perf:host,layer` picks parts. The build targets MOE_KERNELS_CUDA_ARCHS (default here: 90a, the GPU
# runs' H100/H200). PERF_DRY_RUN=1 runs the same parts on the CPU with tiny shapes (CI does, with
# MOE_KERNELS_EMULATE=1, so this stage cannot break unnoticed between GPU runs).
#
# GPU_CHECK_BUDGET=SECONDS caps the whole run (e.g. 540 for one 10-minute command): each stage gets what is
# left, and `bench` runs its families in priority order, each capped, skipping those that no longer fit.
# The GPU tier runs on TEST_WORKERS pytest-xdist workers (default 8; 1 without xdist), each test cut at
# TEST_TIMEOUT seconds (default 300, with pytest-timeout), verbose, so a run cut short still lists what
# passed; then the tests marked gpu_memory (tens of GB each) one at a time (gpu_tests_serial.log). On an H200 (2026-11-26): build 64 s with 16 jobs, sanitize 21 s, 854 GPU tests in 240 s on 8
# workers (before the fp64 references moved to the device), the quick benches 10-90 s a family.
#
# `racecheck` runs compute-sanitizer's racecheck and synccheck over small cases of every kernel family with a
# barrier (not in the default stages: it is for a run that has the minutes).
#
# `tune` sweeps the grouped GEMM instances (bench tune_grouped_mm), installs the table it writes and rebuilds
# _C with it: `build tune perf:gemm` measures the tuned choice against torch._grouped_mm.
#
# `test:PATH` runs the GPU tier of one part of tests/ (e.g. test:tests/ops/test_grouped_mm_gpu.py), for when
# the whole tier does not fit one command; `test:PATH,PATH,...` runs several parts in one pytest session.
# `bench:OP` runs one benchmark family (permute, router, router_losses, quant, grouped_mm, grouped_mm_fp8, moe_layer, lora, dispatch, train), for when the whole
# suite does not fit one command; BENCH_ARGS=--quick runs the short sweep. moe_layer takes several minutes
# even with --quick (five models, four peers, fp64 checks): give it a command of its own.
#
# Each stage fits in one 10-minute command. OUTDIR keeps two files (a remote runner may return only a
# handful): summary.md (one line per stage) and artifacts.tgz holding every log, the JUnit XML, the
# benchmark JSON and the plots, merged across runs. CUTLASS comes from CUTLASS_DIR, or from an
# nvidia-cutlass wheel in .whl/ (unpacked here), since the machine cannot download it; a liger-kernel
# wheel in .whl/ is installed for the layer bench's Liger peer.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR [build|test|sanitize|bench]...}
shift
STAGES=${*:-build sanitize test bench}
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"
T0=$(date +%s)
BENCH_ORDER="grouped_mm permute router grouped_mm_fp8 quant router_losses dispatch train lora moe_layer"

left() {  # seconds left of GPU_CHECK_BUDGET (a large number without one)
  if [ -n "${GPU_CHECK_BUDGET:-}" ]; then echo $((GPU_CHECK_BUDGET - ($(date +%s) - T0))); else echo 86400; fi
}

capped() {  # SECONDS CMD...: CMD under `timeout` (SIGINT first, so pytest still prints its summary)
  local secs=$1
  shift
  if [ "$secs" -lt 1 ]; then  # the budget is spent (timeout 0 would mean no limit at all)
    echo "skipped: out of time" >&2
    return 124
  fi
  timeout -s INT -k 15 "$secs" "$@"
}

has_module() { "$PY" -c "import $1" >/dev/null 2>&1; }
SUMMARY="$OUT/summary.md"
[ -f "$SUMMARY" ] || printf '| stage | result | seconds | detail |\n|---|---|---|---|\n' >"$SUMMARY"

record() {  # stage rc seconds detail
  local result=pass
  [ "$2" -eq 0 ] || result="FAIL (rc $2)"
  printf '| %s | %s | %s | %s |\n' "$1" "$result" "$3" "$4" >>"$SUMMARY"
}

stage_build() {
  if [ -z "${CUTLASS_DIR:-}" ] && ls .whl/nvidia_cutlass-*.whl >/dev/null 2>&1; then
    rm -rf /tmp/cutlass_wheel && mkdir -p /tmp/cutlass_wheel
    "$PY" -m zipfile -e "$(ls .whl/nvidia_cutlass-*.whl | head -1)" /tmp/cutlass_wheel
    export CUTLASS_DIR=/tmp/cutlass_wheel/cutlass_library/source
  fi
  # The CPU-executed kernels (_C_emu) are CI's; a GPU machine needs only _C.
  MOE_KERNELS_CUDA_ARCHS=${MOE_KERNELS_CUDA_ARCHS:-90a} \
  MOE_KERNELS_SKIP_EMU=${MOE_KERNELS_SKIP_EMU:-1} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    capped "$(left)" "$PY" -m pip install --no-build-isolation --no-deps -v -e . >"$OUT/build.log" 2>&1
  local rc=$?
  # Peers brought as wheels (no network there): Liger's fused MoE for the layer bench.
  for whl in .whl/liger_kernel-*.whl; do
    [ -f "$whl" ] && "$PY" -m pip install --no-deps --no-index "$whl" >>"$OUT/build.log" 2>&1
  done
  "$PY" -m moe_kernels >>"$OUT/build.log" 2>&1
  echo "$rc"
}

test_tag() {  # a file-name suffix for a test stage's path (several paths: their first, and how many)
  [ -n "${1:-}" ] || return 0
  local first=${1%%,*} n
  n=$(echo "$1" | tr ',' '\n' | wc -l)
  if [ "$n" -gt 1 ]; then echo "_$(echo "$first" | tr '/.' '__')_and_$((n - 1))"; else echo "_$(echo "$first" | tr '/.' '__')"; fi
}

stage_test() {  # [path under the repo, or several joined by commas]
  local tag paths
  tag=$(test_tag "${1:-}")
  read -r -a paths <<<"${1//,/ }"
  [ "${#paths[@]}" -gt 0 ] || paths=(tests)
  local extra=()
  has_module xdist && extra+=(-n "${TEST_WORKERS:-8}")
  has_module pytest_timeout && extra+=(--timeout "${TEST_TIMEOUT:-300}" --timeout-method=thread)
  capped "$(left)" "$PY" -m pytest -v -rfE --durations=30 -m "gpu and not gpu_memory" -p no:cacheprovider \
    "${extra[@]}" --junitxml="$OUT/gpu_tests$tag.xml" "${paths[@]}" >"$OUT/gpu_tests$tag.log" 2>&1
  local rc=$?
  # Tests holding tens of GB each, one at a time (beside seven workers they ran out of an H200's memory).
  extra=()
  has_module pytest_timeout && extra+=(--timeout "${TEST_TIMEOUT:-300}" --timeout-method=thread)
  capped "$(left)" "$PY" -m pytest -v -rfE --durations=30 -m "gpu and gpu_memory" -p no:cacheprovider \
    "${extra[@]}" --junitxml="$OUT/gpu_tests${tag}_serial.xml" "${paths[@]}" >"$OUT/gpu_tests${tag}_serial.log" 2>&1
  local rc2=$?
  [ "$rc2" -eq 5 ] && rc2=0  # none selected under this path
  [ "$rc" -eq 5 ] && rc=0
  echo $(( rc != 0 ? rc : rc2 ))
}

stage_sanitize() {
  # A short subset: memcheck slows kernels ~100x and Python start-up too.
  capped "$(left)" compute-sanitizer --tool memcheck --error-exitcode 9 --target-processes all \
    "$PY" -m pytest -q -p no:cacheprovider tests/ops/test_permute_gpu.py tests/ops/test_router_gpu.py \
    tests/ops/test_router_losses_gpu.py tests/ops/test_quant_gpu.py tests/ops/test_nvfp4_gpu.py \
    tests/ops/test_grouped_mm_fp8_gpu.py tests/ops/test_grouped_mm_gpu.py tests/ops/test_activation_gpu.py \
    tests/dispatch/test_nvlink.py tests/ops/test_grouped_mm_fp8_mma_gpu.py \
    -k "test_forward_unaligned or (test_forward_matches_fp64 and uniform-64-196) or (test_wgrad_matches_fp64 and empty-72-199) or nvlink_capacity or nvlink_payloads or (nvlink_virtual_ranks and 4) or sizes_past_m or degenerate_sizes or portable_path or (test_matches_fp64 and (dtype0-empty-8 or dtype1-single-1 or True-dtype0-37-3)) or tiny_and_odd or misaligned or out_of_range or low_precision or (matches_reference and (7-8-2 or 0-1-1 or 1-256-8 or -2048-64-4)) or non_finite or (aux_scores and 1-64-8) or capacity_edge_cases or dtypes_and_specials or (test_aux_loss and 7-64-4) or (test_seq_aux_loss and 3-7-8-2) or (test_z_loss and 7-3) or specials_formats or misaligned_rows or (quantize_matches_reference and (7-300 or 7-48)) or nan_and_inf or misaligned_input or (matches_fp64_reference and (1-128-128-1 or 64-200-256-2 or 64-196-256-2 or 300-256-384-8))" \
    >"$OUT/sanitizer.log" 2>&1
  echo $?
}

stage_racecheck() {
  # Shared-memory hazards (racecheck) and barrier misuse (synccheck) in the code as it is, on small cases of
  # every kernel family with a barrier: the CPU-executed kernels show a missing barrier only where the order
  # of threads changes a result, and never where a shuffle or match stands between the accesses (CUDA orders
  # memory only at __syncwarp and __syncthreads; docs/testing.md, races).
  local files=(tests/ops/test_permute_gpu.py tests/ops/test_router_gpu.py tests/ops/test_router_fused_gpu.py
    tests/ops/test_router_losses_gpu.py tests/ops/test_quant_gpu.py tests/ops/test_quantize_tokens_gpu.py
    tests/ops/test_swiglu_fp8_gpu.py tests/ops/test_rows_fp8_gpu.py tests/ops/test_permute_quantize_fp8_gpu.py
    tests/ops/test_fp8_dequant_scales_gpu.py
    tests/ops/test_activation_gpu.py tests/ops/test_grouped_mm_gpu.py tests/dispatch/test_nvlink.py tests/ops/test_grouped_mm_fp8_mma_gpu.py)
  local k="(test_forward_matches_fp64 and uniform-300-256) or (test_wgrad_matches_fp64 and uniform-256-384) or (matches_reference and (7-8-2 or 0-1-1 or 130-16 or 4160 or fp32-softmax-999-16 or fp32-deepseek-999 \
or fp32-sigmoid_unnormalized-999)) or tokens_past_the_grid or nvlink_capacity or (test_aux_loss and (7-64-4 or 512-2048)) \
or (test_seq_aux_loss and 3-7-8-2) or (test_z_loss and 7-3) or (quantize_matches_reference and 7-300) \
or (matches_composition and (dtype0-128-129 or dtype0-200-129 or dtype0-128-37-8-2)) or (test_matches_fp64 and True-dtype2-300-2048) or portable_path \
or misaligned_rows or tiny_and_odd or (test_matches_reference and 33x65-65x33-t)"
  capped "$(left)" compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
    --target-processes all "$PY" -m pytest -q -p no:cacheprovider "${files[@]}" -k "$k" >"$OUT/racecheck.log" 2>&1
  local rc=$?
  capped "$(left)" compute-sanitizer --tool synccheck --error-exitcode 9 --target-processes all \
    "$PY" -m pytest -q -p no:cacheprovider "${files[@]}" -k "$k" >"$OUT/synccheck.log" 2>&1
  local rc2=$?
  echo $(( rc != 0 ? rc : rc2 ))
}

stage_perf() {  # [part,part,...]
  local budget=${PERF_BUDGET:-360} cap
  cap=$(left)
  # The parts keep to --budget; the timeout only stops a hang. With less left of GPU_CHECK_BUDGET than
  # that, the budget shrinks so the parts stop between families rather than being cut inside one.
  [ "$cap" -lt $((budget + 60)) ] && budget=$((cap > 90 ? cap - 60 : 30))
  [ "$cap" -gt $((budget + 60)) ] && cap=$((budget + 60))
  local dry=()
  [ -n "${PERF_DRY_RUN:-}" ] && dry=(--dry-run)
  capped "$cap" "$PY" -m bench.perf "$OUT" --budget "$budget" ${1:+--parts "$1"} "${dry[@]}" >"$OUT/perf.log" 2>&1
  echo $?
}

stage_tune() {
  # The grouped GEMM tuning sweep (bench tune_grouped_mm, ~4 minutes on an H100/H200): its table is installed
  # into this copy's csrc/gemm/sm90_table.h and _C rebuilt with it, so a `perf:gemm` after this stage measures
  # the tuned choice. The table comes back as tune_sm90_table.txt (commit it as csrc/gemm/sm90_table.h).
  capped "$(left)" "$PY" -m bench tune_grouped_mm --out "$OUT" >"$OUT/tune.log" 2>&1
  local rc=$?
  if [ "$rc" -eq 0 ] && [ -f "$OUT/sm90_table.h" ]; then
    cp "$OUT/sm90_table.h" csrc/gemm/sm90_table.h
    cp "$OUT/sm90_table.h" "$OUT/tune_sm90_table.txt"
    [ -f "$OUT/build.log" ] && mv "$OUT/build.log" "$OUT/build_before_tune.log"
    rc=$(stage_build)
  fi
  echo "$rc"
}

stage_bench() {  # [op]; BENCH_ARGS=--quick for the short sweep
  if [ -n "${1:-}" ]; then
    capped "$(left)" "$PY" -m bench "$1" ${BENCH_ARGS:-} --out "$OUT" >"$OUT/bench_$1.log" 2>&1
    echo $?
    return
  fi
  # Every family, one process each, in priority order; with a budget each gets at most BENCH_CAP seconds.
  local rc=0 op cap
  for op in $BENCH_ORDER; do
    cap=$(left)
    [ -n "${GPU_CHECK_BUDGET:-}" ] && [ "$cap" -gt "${BENCH_CAP:-120}" ] && cap=${BENCH_CAP:-120}
    if [ "$cap" -lt 20 ]; then
      echo "skipped: out of time" >"$OUT/bench_$op.log"
      rc=1
      continue
    fi
    capped "$cap" "$PY" -m bench "$op" ${BENCH_ARGS:-} --out "$OUT" >"$OUT/bench_$op.log" 2>&1 || rc=1
  done
  cat "$OUT"/bench_*.log >"$OUT/bench.log"
  echo $rc
}

overall=0
for stage in $STAGES; do
  start=$(date +%s)
  name=${stage%%:*}
  arg=${stage#"$name"}
  rc=$("stage_$name" ${arg#:})
  secs=$(( $(date +%s) - start ))
  case $name in
    build) detail=$(grep -m1 -E "extension_archs" "$OUT/build.log" | tr -s ' ') ;;
    test) detail="$(tail -n 1 "$OUT/gpu_tests$(test_tag "${arg#:}").log"); serial: $(tail -n 1 "$OUT/gpu_tests$(test_tag "${arg#:}")_serial.log")" ;;
    sanitize) detail=$(grep -m1 -E "ERROR SUMMARY" "$OUT/sanitizer.log"; tail -n 1 "$OUT/sanitizer.log") ;;
    racecheck) detail="racecheck: $(grep -m1 -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/racecheck.log"; tail -n 1 "$OUT/racecheck.log"); synccheck: $(grep -m1 -E "ERROR SUMMARY" "$OUT/synccheck.log"; tail -n 1 "$OUT/synccheck.log")" ;;
    bench) log="$OUT/bench${arg:+_${arg#:}}.log"; detail=$(grep -E "^HEADLINE" "$log" | tr '\n' ' ') ;;
    perf) detail=$(grep -E "^\[perf\]" "$OUT/perf.log" | tr '\n' ' ') ;;
    tune) detail=$(grep -E "^HEADLINE" "$OUT/tune.log" | tr '\n' ' ') ;;
    *) detail="unknown stage" ;;
  esac
  record "$stage" "$rc" "$secs" "${detail//|//}"
  [ "$rc" -eq 0 ] || overall=1
  echo "[$stage] rc=$rc ${secs}s $detail"
done
pack() {
  local tmp
  tmp=$(mktemp -d)
  [ -f "$OUT/artifacts.tgz" ] && tar xzf "$OUT/artifacts.tgz" -C "$tmp"
  for f in "$OUT"/*.log "$OUT"/*.png "$OUT"/*.xml "$OUT"/*.json "$OUT"/*.txt; do
    [ -f "$f" ] && mv "$f" "$tmp/"
  done
  tar czf "$OUT/artifacts.tgz" -C "$tmp" .
  rm -rf "$tmp"
}

pack
cat "$SUMMARY"
exit $overall  # non-zero when any stage failed (CI's perf dry run relies on it)
