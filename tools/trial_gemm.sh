#!/usr/bin/env bash
# TRIAL branch (trial/gemm-anatomy), one device call (~2 min with the machine's start): the gate/up
# kernels' tests first (the ping-pong kernel is new: bounded by timeouts in case it hangs), then the
# table: cuBLAS's GEMM alone, the fused kernel, its mainloop without the epilogue, with 3 K slots, and
# the ping-pong kernel (each warpgroup's epilogue under the other's MMAs). Keep ping-pong only if it
# beats the cooperative kernel at the block MLP's rows; else record it in docs/PERFORMANCE.md.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD
timeout 180 python3 -m pytest -q -x tests/test_kernels_gpu.py -k "gate_up" 2>&1 | tail -4
timeout 240 python3 benchmarks/bench_kernels.py --gate-up-only
