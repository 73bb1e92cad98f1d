#!/usr/bin/env bash
# A/B of the optional C helpers (_fast.c, _slab.c) on one box, in one run: the
# submit_overhead suite with KVTIER_NATIVE=1 and KVTIER_NATIVE=0 in turn, $AB_ROUNDS rounds each
# (default 2), then one table of the hot submit time per row and side (ab_native_summary.py).
#   KVTIER_COMMIT=<sha> bash lab/ab_native.sh
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=src:. PYTHONUNBUFFERED=1
export KVTIER_COMMIT=${KVTIER_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
  --format=csv > "$out/nvidia-smi.txt" 2>&1
suffix=$($py -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
inc=$($py -c "import sysconfig; print(sysconfig.get_paths()['include'])")
gcc -O2 -shared -fPIC -I"$inc" src/kvtier/_fast.c -o "src/kvtier/_fast$suffix"
gcc -O2 -shared -fPIC -I"$inc" src/kvtier/_slab.c -o "src/kvtier/_slab$suffix"
for r in $(seq 1 "${AB_ROUNDS:-2}"); do
  for native in 1 0; do
    echo "== round $r KVTIER_NATIVE=$native" | tee -a "$out/ab.log"
    KVTIER_NATIVE=$native $py -c "from kvtier.engine.fastpath.fast import status; print('C helper:', status())" \
      | tee -a "$out/ab.log"
    KVTIER_NATIVE=$native $py -c "from kvtier.slab import status; print('C slab:', status())" | tee -a "$out/ab.log"
    mkdir -p "$out/n${native}r$r"
    KVTIER_NATIVE=$native timeout 240 $py -m lab bench --out "$out/n${native}r$r" --suite submit_overhead \
      2>&1 | grep -v "step/s" | tail -20 >> "$out/ab.log"
  done
done
$py lab/ab_native_summary.py "$out" | tee "$out/ab_summary.md"
