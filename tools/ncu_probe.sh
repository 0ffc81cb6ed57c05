#!/usr/bin/env bash
# Hardware counters (Nsight Compute) of gem's attention kernels: one fwd+bwd per kernel_probe case, after its warm-up
# (compile, autotune), so only the tuned launches are profiled. Needs ncu (the H200 image has it).
#   bash tools/ncu_probe.sh [kernel_probe args: --cases jfa --match causal]
# Writes $OUT/ncu.ncu-rep and $OUT/ncu_details.txt (speed of light, occupancy, launch, warp stall reasons per
# kernel), $OUT/ncu_raw.csv (every collected metric, one row per kernel) and $OUT/ncu_source.csv (stall samples
# per source line).
set -eu
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$ROOT/outputs/ncu}
mkdir -p "$OUT"
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
[ -n "$NCU" ] || { echo "ncu_probe: no ncu on this machine"; exit 2; }
cd "$ROOT"
# --clock-control none: leave the GPU clocks as they are (the tool library's METHOD.md)
"$NCU" --clock-control none --profile-from-start off --target-processes all -f -o "$OUT/ncu" \
    -k 'regex:^_' \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section InstructionStats --section SourceCounters --import-source yes \
    python3 tools/kernel_probe.py --ncu "$@"
"$NCU" --import "$OUT/ncu.ncu-rep" --page details > "$OUT/ncu_details.txt"
"$NCU" --import "$OUT/ncu.ncu-rep" --page raw --csv > "$OUT/ncu_raw.csv" || echo "ncu_probe: raw page failed"
# per source line (the kernels' Python lines): warp stall samples, where the time goes inside a kernel
"$NCU" --import "$OUT/ncu.ncu-rep" --page source --csv --print-source cuda > "$OUT/ncu_source.csv" \
    || echo "ncu_probe: source page failed"
grep -E '^  _|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Stall' "$OUT/ncu_details.txt" | head -400
