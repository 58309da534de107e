#!/usr/bin/env bash
# TRIAL branch (trial/gemm-anatomy), one device call (~4 min with the machine's start):
#  1. the gemm_sm90 kernels' tests (the two ping-pong kernels are new: bounded by timeouts in case one hangs);
#  2. bench_kernels' gate/up table: cuBLAS's GEMM alone, the fused kernel, its mainloop without the
#     epilogue, with 3 K slots, and the ping-pong gate/up kernel; then attn.proj and mlp.down_proj (+= into
#     fp32) by cuBLAS against the ping-pong accumulate kernel;
#  3. the default path's graph and batch model tests; the forward with cuBLAS's residual GEMMs against
#     the ping-pong ones (layers.RESIDUAL_PINGPONG), alternating, and their outputs compared.
# Keep a ping-pong kernel only where it beats what runs now; record the rest in docs/PERFORMANCE.md.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src:$PWD
timeout 180 python3 -m pytest -q -x tests/test_kernels_gpu.py -k "gate_up or accumulate" 2>&1 | tail -4
timeout 240 python3 benchmarks/bench_kernels.py --gate-up-only
timeout 120 python3 -m pytest -q tests/test_model_gpu.py -k "graph or batch" 2>&1 | tail -2  # the default path
timeout 200 python3 tools/trial_gemm_forward.py
