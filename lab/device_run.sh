#!/usr/bin/env bash
# One device run: GPU tests, compute-sanitizer, probe, benchmark suites (kvtier's and the lab's, one
# `python -m lab bench` each). Everything lands in $OUT (or ./out). From the repository root:
#   bash lab/device_run.sh MODE
#   smoke: GPU tests + `bench --quick`     tests: GPU tests + memcheck     bench: probe + all suites
#   full: tests + bench  (extra arguments go to pytest; BENCH_ARGS to `python -m lab bench`)
#   engine-tests: GPU tests + memcheck (kernels, engine) + racecheck/synccheck (engine) + `kvtier trace`
#   engine-bench: probe + suites bidir, save_beside_matmul, submit_overhead, gather_d2d
#   engine-all: GPU tests + engine-bench
#   models: ($GPU_TESTS: those first) host_jitter.py, kvtier calibrate, suites ttft (calibrated) + submit_overhead
#   models-hf: suite hf, `kvtier demo` on the GPU (+ Redis when carried); with $KVTIER_CALIBRATION, ttft too
#   ttft-hf: GPU tests ($GPU_TESTS: those), suites ttft + hf ($KVTIER_CALIBRATION)
#   planner: ($GPU_TESTS) the ttft suite as a new user runs it (no calibration file, an empty first-use
#       cache) into $out/uncal.*, then kvtier calibrate, then the ttft suite with that calibration
#       into $out/cal.* (#30: the planner out of the box and calibrated). Both sides take ~9-10 min
#       on an H200, over one device call's limit: PLANNER_SIDES=uncal in one call, PLANNER_SIDES=cal
#       in the next (a calibration only holds on the box it was made on: each call is a new box)
#   verdict: ($GPU_TESTS) suites $P6_SUITES (default bidir save_beside_matmul submit_overhead), then
#       submit_overhead $P6_REPEAT more times (default 0) into $out/again<i>/: the targets' figures at one commit
#       (with P6_REPEAT=1 it writes 7 files; the device tool returns 8 at most, so add one file at most)
#   noisy: ($GPU_TESTS) suite submit_overhead beside lab/host_load.py workers, for each count
#       in $NOISY_PROCS (default "0 8 14"; kind $NOISY_KIND, default copy, or count:kind items such as
#       "15:spin 14:copy"): P6 on a host made slow on purpose; writes noisy<count><kind>.json and noisy.log
#   vllm: ($GPU_TESTS) `kvtier bench --suite vllm $VLLM_ARGS` (the connector's replay harness, #28) into
#       $out/vllm.json and vllm.bench.log; KVTIER_VLLM_ORDERS limits the orders, KVTIER_VLLM_ROWS the row
#       families (transfers, kernels, ttft, full_graph, beside_save, failover, decode); the Redis row needs a
#       redis-server on PATH and redis-py importable (carried: see lab/RUNS.md)
#   multi: (2+ GPUs) handoff/probe GPU tests, memcheck/racecheck of a handoff, probe --all-gpus,
#          suites handoff + contention, `kvtier path` with the measured sharing
# The probe scripts of earlier modes (p6, states, calls, cold, ab, events-ab, lean, ttft-probe,
# engine-store) are retired: lab/NOTES.md gives their findings and the commit that still has them.
set -uo pipefail
mode=${1:-full}
shift || true
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=src:.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # carried wheels' folder kept
# a tree copied to a GPU box has no .git: pass the commit in: KVTIER_COMMIT=<sha> bash lab/device_run.sh
export KVTIER_COMMIT=${KVTIER_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}
py=${PYTHON:-python3}

nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.sm,clocks.mem \
  --format=csv > "$out/nvidia-smi.txt" 2>&1
$py -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))" | tee -a "$out/nvidia-smi.txt"

# The submit path's C helpers (engine/fastpath/fast.py, slab.py) for this box's Python: no install here, so
# built in place.
if [ "${KVTIER_NATIVE:-1}" != 0 ]; then
  suffix=$($py -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
  inc=$($py -c "import sysconfig; print(sysconfig.get_paths()['include'])")
  for tree in . ${AB_OLD:-.ab_old}; do  # an A/B's older side too, where it has the helpers
    [ -d $tree/src/kvtier ] || continue  # no A/B tree in this run
    for c in src/kvtier/_fast.c src/kvtier/engine/fastpath/_fast.c; do  # where it is, and where it was
      [ -f $tree/$c ] && gcc -O2 -shared -fPIC -I"$inc" $tree/$c -o "$tree/${c%.c}$suffix" 2>&1 | tail -3
    done
    if [ -f $tree/src/kvtier/_slab.c ]; then
      gcc -O2 -shared -fPIC -I"$inc" $tree/src/kvtier/_slab.c -o "$tree/src/kvtier/_slab$suffix" 2>&1 | tail -3
    fi
    PYTHONPATH=$tree/src $py -c "from kvtier.engine.fastpath.fast import status; print('C helper ($tree):', status())"
    PYTHONPATH=$tree/src $py -c "from kvtier.slab import status; print('C slab ($tree):', status())" 2>/dev/null
  done
fi

gpu_tests() {  # $GPU_TESTS: pytest arguments, the GPU tests a change touched
  if [ -n "${GPU_TESTS:-}" ]; then
    echo "== GPU tests"
    timeout ${GPU_TIMEOUT:-200} $py -m pytest -q -p no:cacheprovider $GPU_TESTS 2>&1 | tail -40 | tee "$out/pytest-gpu.log"
  fi
}
p6_suites() {  # $P6_SUITES: suites of `python -m lab bench`
  if [ -n "${P6_SUITES:-}" ]; then
    echo "== bench $P6_SUITES"
    timeout ${BENCH_TIMEOUT:-360} $py -m lab bench --out "$out" $(for s in $P6_SUITES; do echo --suite $s; done) \
      2>&1 | tee "$out/bench.log" | tail -40
  fi
}

if [ "$mode" = engine-tests ]; then
  echo "== GPU tests"
  timeout 300 $py -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors tests lab/tests 2>&1 \
    | tail -30 | tee "$out/pytest-gpu.log"
  for tool in memcheck racecheck synccheck; do
    case $tool in
      memcheck) sel="tests/ops/test_kernels_gpu.py tests/engine/test_engine_gpu.py"; k="not llama" ;;
      *) sel="tests/engine/test_engine_gpu.py"; k="round_trip" ;;
    esac
    echo "== compute-sanitizer $tool: $sel -k '$k'"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool $tool --error-exitcode 99 \
      $([ $tool = memcheck ] && echo --leak-check no) $py -m pytest -q -p no:cacheprovider $sel -k "$k" \
      > "$out/$tool.log" 2>&1
    echo "$tool exit code: $?" | tee -a "$out/$tool.log"
    tail -4 "$out/$tool.log"
  done
  echo "== kvtier trace on the GPU"
  timeout 120 $py -m kvtier trace --device cuda --out "$out/trace.png" 2>&1 | tail -5
  exit 0
fi
# Redis on a GPU box without it: `carry` .whl (redis-py wheel + Debian's redis-server and its libs)
if [ -d .whl ]; then
  $py -m pip install -q --no-deps --target /tmp/kvtier-pydeps .whl/*.whl > "$out/pip.log" 2>&1  # redis-py, hiredis
  export PYTHONPATH=src:.:/tmp/kvtier-pydeps PATH="$PWD/.whl/redis-bin:$PATH"
fi
export KVTIER_BENCH_DIR=${KVTIER_BENCH_DIR:-$PWD/.benchdisk}  # the box's disk, not a tmpfs
mkdir -p "$KVTIER_BENCH_DIR"

if [ "$mode" = ttft-hf ]; then
  echo "== GPU tests"
  timeout 200 $py -m pytest -q -p no:cacheprovider ${GPU_TESTS:--m gpu tests lab/tests} 2>&1 | tail -15 | tee "$out/pytest-gpu.log"
  echo "== bench ttft, hf"
  timeout 420 $py -m lab bench --out "$out" --suite ttft --suite hf 2>&1 | tee "$out/bench.log" | tail -50
  exit 0
fi
if [ "$mode" = models ]; then
  gpu_tests
  if [ "${JITTER:-1}" = 1 ]; then  # JITTER=0 skips it
    echo "== host jitter"
    timeout 60 $py lab/host_jitter.py 2>&1 | tee "$out/host_jitter.txt"
  fi
  echo "== calibrate"
  timeout 140 $py -m kvtier calibrate --save "$out/calibration.json" 2>&1 | tee "$out/calibrate.log" | tail -40
  echo "== bench ttft, submit_overhead"
  KVTIER_CALIBRATION="$out/calibration.json" timeout 360 $py -m lab bench --out "$out" --suite ttft \
    --suite submit_overhead 2>&1 | tee "$out/bench.log" | tail -60
  exit 0
fi
if [ "$mode" = planner ]; then
  gpu_tests
  export KVTIER_CACHE_DIR=$(mktemp -d)  # a new user's machine: no first-use costs measured yet
  for side in ${PLANNER_SIDES:-uncal cal}; do
    if [ $side = cal ]; then
      echo "== calibrate"
      timeout ${CAL_TIMEOUT:-150} $py -m kvtier calibrate --save "$out/calibration.json" 2>&1 \
        | tee "$out/calibrate.log" | tail -30
      export KVTIER_CALIBRATION="$out/calibration.json"
    fi
    echo "== bench ttft ($side)"
    tmp=$(mktemp -d)  # the plot stays there: the device tool returns 8 files at most
    timeout ${BENCH_TIMEOUT:-250} $py -m kvtier bench --out "$tmp" --suite ttft 2>&1 | tee "$out/$side.bench.log" | tail -50
    cp "$tmp"/*.json "$out/$side.json" 2>/dev/null
  done
  exit 0
fi
if [ "$mode" = vllm ]; then
  gpu_tests
  echo "== bench vllm ${VLLM_ARGS:-}"
  tmp=$(mktemp -d)  # the plot stays there: the device tool returns 8 files at most
  timeout ${BENCH_TIMEOUT:-480} $py -m kvtier bench --out "$tmp" --suite vllm ${VLLM_ARGS:-} 2>&1 \
    | tee "$out/vllm.bench.log" | tail -70
  cp "$tmp"/*.json "$out/vllm.json" 2>/dev/null
  exit 0
fi
if [ "$mode" = verdict ]; then
  gpu_tests
  P6_SUITES=${P6_SUITES:-bidir save_beside_matmul submit_overhead} BENCH_TIMEOUT=${BENCH_TIMEOUT:-420} p6_suites
  for i in $(seq 1 "${P6_REPEAT:-0}"); do  # the same suite again on the same box: how much the verdict moves
    echo "== bench submit_overhead, again ($i)"
    mkdir -p "$out/again$i"
    timeout 240 $py -m lab bench --out "$out/again$i" --suite submit_overhead 2>&1 \
      | tee "$out/again$i/bench.log" | tail -16
    rm -f "$out/again$i"/*.png  # the json and log carry the figures; the file count back is limited
  done
  exit 0
fi
if [ "$mode" = noisy ]; then  # P6 on a host loaded on purpose (lab/host_load.py)
  gpu_tests
  for item in ${NOISY_PROCS:-0 8 14}; do
    procs=${item%%:*}
    kind=$([ "$item" = "$procs" ] && echo ${NOISY_KIND:-copy} || echo ${item#*:})
    echo "== submit_overhead beside $procs $kind workers" | tee -a "$out/noisy.log"
    pid=
    if [ "$procs" -gt 0 ]; then
      $py lab/host_load.py --procs $procs --kind $kind --seconds 600 >> "$out/noisy.log" &
      pid=$!  # host_load's own pid: its SIGTERM handler stops the workers
      sleep 3  # the workers running before the suite's first sample
    fi
    tmp=$(mktemp -d)  # the suite's plot stays there: the device tool returns 8 files at most
    timeout ${BENCH_TIMEOUT:-200} $py -m lab bench --out "$tmp" --suite submit_overhead 2>&1 \
      | tail -20 | tee -a "$out/noisy.log"
    cp "$tmp"/*.json "$out/noisy$procs$kind.json"
    if [ -n "$pid" ]; then kill -TERM $pid; wait $pid 2>/dev/null; fi  # (pkill -f would match a caller's command line)
  done
  exit 0
fi
if [ "$mode" = models-hf ]; then
  if [ -n "${KVTIER_CALIBRATION:-}" ]; then  # the ttft suite again, with a committed calibration
    echo "== bench ttft"
    timeout 240 $py -m lab bench --out "$out/ttft" --suite ttft 2>&1 | tee "$out/bench-ttft.log" | tail -40
  fi
  echo "== bench hf"
  timeout 330 $py -m lab bench --out "$out" --suite hf 2>&1 | tee "$out/bench.log" | tail -40
  echo "== demo on the GPU"
  r=$(command -v redis-server >/dev/null && echo yes)
  [ -n "$r" ] && { redis-server --port 6399 --save "" --daemonize yes > /dev/null; sleep 0.5; }
  timeout 150 $py -m kvtier demo --device cuda --plot "$out/demo-ttft.png" ${r:+--redis redis://127.0.0.1:6399} \
    2>&1 | tee "$out/demo.log" | tail -30
  exit 0
fi
if [ "$mode" = multi ]; then
  nvidia-smi topo -m > "$out/topo.txt" 2>&1; cat "$out/topo.txt"
  echo "== GPU tests of several GPUs"
  timeout 300 $py -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_handoff_gpu.py tests/integrations/test_handoff_hf.py \
    tests/bench/test_probe_multi.py tests/bench/test_bench_multi.py 2>&1 | tail -20 | tee "$out/pytest-multi.log"
  for tool in memcheck racecheck; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 200 compute-sanitizer --tool $tool --error-exitcode 99 \
      $([ $tool = memcheck ] && echo --leak-check no) $py -m pytest -q -p no:cacheprovider \
      tests/engine/test_handoff_gpu.py -k "round_trip and vllm_flash" > "$out/handoff-$tool.log" 2>&1
    echo "$tool exit code: $?" | tee -a "$out/handoff-$tool.log"; tail -3 "$out/handoff-$tool.log"
  done
  echo "== probe --all-gpus"
  timeout 300 $py -m kvtier probe --all-gpus --save "$out/ceilings-multi.json" 2>&1 | tee "$out/probe-multi.log" | tail -30
  echo "== bench handoff, contention"
  timeout 400 $py -m lab bench --out "$out" --suite handoff --suite contention 2>&1 | tee "$out/bench.log" | tail -30
  echo "== path with the measured sharing"
  $py -m kvtier path --model llama-3-8b --tokens 32768 --shared-by 2 --ceilings "$out/ceilings-multi.json" 2>&1 | tail -20 \
    | tee "$out/path-multi.txt"
  exit 0
fi
if [ "$mode" = engine-all ]; then
  echo "== GPU tests"
  timeout 200 $py -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors tests lab/tests 2>&1 \
    | tail -30 | tee "$out/pytest-gpu.log"
  mode=engine-bench
fi
if [ "$mode" = engine-bench ]; then
  timeout 200 $py -m kvtier probe --save "$out/ceilings-h200.json" > "$out/probe.log" 2>&1
  timeout 500 $py -m lab bench --out "$out" --suite bidir --suite save_beside_matmul \
    --suite submit_overhead --suite gather_d2d 2>&1 | tee "$out/bench.log" | tail -40
  exit 0
fi

if [ "$mode" != bench ]; then
echo "== GPU tests"
# the device image lacks redis-py: the store's Redis tests cannot be collected there (they run in CI)
timeout 400 $py -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors tests "$@" 2>&1 \
  | tail -60 | tee "$out/pytest-gpu.log"
fi

if [ "$mode" = smoke ]; then
  echo "== bench --quick"
  timeout 300 $py -m lab bench --quick --out "$out" 2>&1 | tail -60 | tee "$out/bench.log"
  exit 0
fi

if [ "$mode" != bench ]; then
echo "== compute-sanitizer memcheck on the GPU kernel tests"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 99 $py -m pytest -q -p no:cacheprovider \
  tests/ops/test_kernels_gpu.py -k "${MEMCHECK_K:-small}" > "$out/memcheck.log" 2>&1
echo "memcheck exit code: $?" | tee -a "$out/memcheck.log"
tail -5 "$out/memcheck.log"
fi
[ "$mode" = tests ] && exit 0

echo "== probe"
timeout 300 $py -m kvtier probe --save "$out/ceilings-h200.json" 2>&1 | tee "$out/probe.log"

echo "== bench (all suites)"
timeout 900 $py -m lab bench --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | tail -80

echo "== profiler timeline of one suite (Chrome trace: open in Perfetto or Nsight Systems)"
timeout 300 $py -m lab bench --quick --suite save_d2h --no-plot --out /tmp/kvtier-profile \
  --profile "$out/trace-save_d2h.json" 2>&1 | tail -3
ls -la "$out"
