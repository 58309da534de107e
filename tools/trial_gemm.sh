#!/usr/bin/env bash
# TRIAL branch (trial/gemm-anatomy): where the fused gate/up kernel's time goes, in one device call
# (~1.5 min with the machine's start): cuBLAS's GEMM alone, the fused kernel, its mainloop without the
# epilogue, and with 3 K slots; then its tests. Decides whether an epilogue overlapped with the next
# tile's MMA (ping-pong consumers, or an epilogue warpgroup fed through shared memory) is worth building.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD
python3 benchmarks/bench_kernels.py --gate-up-only
python3 -m pytest -q tests/test_kernels_gpu.py -k "gate_up" 2>&1 | tail -2
