#!/usr/bin/env bash
# Everything the GPU machine proves, in one call: the GPU test suite, the parity check against
# HF transformers 5.23.0 and the benchmarks. Short table last; full logs under $OUT.
#   tools/gpu_check.sh [tests|cpu|parity|bench|e2e|video|serve|before|all]...   (default: all)
# tests: the GPU tests and the examples; cpu: the CPU suite (CI runs it too).
# before: the encoder benchmark (ours only) of an older tree unpacked in .old/ (git archive COMMIT setup.cfg src
# cuda benchmarks examples/grace_hopper.jpg | tar -x -C .old), then of this tree, in the same run.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
if compgen -G ".whl/transformers-5.23.0*.whl" >/dev/null && [ ! -d .site/transformers ]; then
    python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl  # transformers + the serve stack
fi
# Optional: nvImageCodec + nvJPEG wheels carried in .whl3 (the gpu-decode extra) for the e2e benchmark.
if compgen -G ".whl3/*.whl" >/dev/null && [ ! -d .site/nvidia/nvimgcodec ]; then
    python3 -m pip install -q --no-index --no-deps --target .site .whl3/*.whl
fi
[ -d .site ] && export PYTHONPATH="$PWD/.site:${PYTHONPATH:-}"
export PYTHONPATH="$PWD/src:$PWD:${PYTHONPATH:-}"
what=${*:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import cupy, numpy, ml_dtypes; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion())"
rc=0
run() { local name=$1; shift; echo "== $name: $*"; "$@" 2>&1 | tee "$OUT/$name.log"; local r=${PIPESTATUS[0]}; echo "== $name rc=$r"; [ $r -eq 0 ] || rc=1; }
case " $what " in *" all "*|*" tests "*)
    run test_gpu python3 -m pytest -q -rs -s -m gpu tests
    run example python3 examples/encode_image.py --save "$OUT/example_embeddings.safetensors"
    run example_video python3 examples/encode_video.py
;; esac
case " $what " in *" all "*|*" cpu "*) run test_cpu python3 -m pytest -q -rs -m "not gpu" tests ;; esac
case " $what " in *" before "*)
    [ -d .old/src ] && run bench_before bash -c "cd .old && python3 benchmarks/bench_encoder.py --no-hf"
    run bench_after python3 benchmarks/bench_encoder.py --no-hf
;; esac
case " $what " in *" all "*|*" parity "*) run parity python3 benchmarks/parity.py ;; esac
case " $what " in *" all "*|*" e2e "*) run bench_e2e python3 benchmarks/bench_e2e.py ;; esac
case " $what " in *" all "*|*" video "*) run bench_video python3 benchmarks/bench_video.py ;; esac
case " $what " in *" all "*|*" serve "*)  # needs the serve extra's wheels carried in .whl
    run bench_serve python3 benchmarks/bench_serve.py
    run bench_serve_small python3 benchmarks/bench_serve.py --small --requests 480
;; esac
case " $what " in *" all "*|*" bench "*)
    run bench_kernels python3 benchmarks/bench_kernels.py
    run bench_encoder python3 benchmarks/bench_encoder.py ${BENCH_ARGS:-}  # e.g. BENCH_ARGS=--no-compiled
    run profile_encoder python3 benchmarks/profile_encoder.py
;; esac
echo "== summary"; grep -h "^|" "$OUT"/*.log 2>/dev/null; grep -h -E "passed|failed" "$OUT"/test_*.log
exit $rc
