"""cuBLAS BF16 GEMMs through CuPy: out[M, N] = a[M, K] @ w[N, K]^T (+ beta * out).

Inputs are bf16 with fp32 accumulation; `out` is bf16 or float32. With a float32
`out` and beta = 1 the product accumulates into it: that is how the encoder adds
each sub-layer to its float32 residual stream without a separate pass.

On a Handle, a shape that gemm_tune.py tuned runs the cublasLt algorithm chosen for the
nearest tuned row count (gemm_lt.py) where cublasLt offers it for the call's exact shape;
every other call runs cublasGemmEx's default pick.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import cupy
import ml_dtypes
import numpy as np
from cupy_backends.cuda.libs import cublas

from . import gemm_lt

BF16 = np.dtype(ml_dtypes.bfloat16)
CUDA_R_16BF, CUDA_R_32F = 14, 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
_ONE = np.ones((), np.float32)
_ZERO = np.zeros((), np.float32)


def _rows(x, name):
    if x.ndim != 2 or x.strides[1] != x.itemsize or x.strides[0] < x.shape[1] * x.itemsize:
        raise ValueError(f"gemm: {name} must be a 2-D row-major array (shape {x.shape}, strides {x.strides})")
    return x.strides[0] // x.itemsize


@functools.cache
def _cublas_fn(name: str, *argtypes):
    """`name` from the libcublas CuPy loaded, called through ctypes, or None. CuPy's wrappers re-bind
    the handle to the current stream on every call and refuse that during graph capture."""
    for path in gemm_lt.loaded_paths("libcublas.so"):
        try:
            fn = getattr(ctypes.CDLL(path), name)
        except (OSError, AttributeError):
            continue
        fn.argtypes = list(argtypes)
        fn.restype = ctypes.c_int
        return fn
    return None


def _cublas_gemm_ex():
    p, i = ctypes.c_void_p, ctypes.c_int
    return _cublas_fn("cublasGemmEx", p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i)


class Handle:
    """A cuBLAS handle of our own, bound once to one stream. CuPy refuses cublasSetStream while a
    stream captures a CUDA graph; a handle that never needs it can be captured.

    Batch invariance: the handle gets no workspace, so cuBLAS cannot split a GEMM's K across thread
    blocks (split-K / stream-K, which it picks for some row counts). Every output row is then summed in
    the same order whatever the other rows are, so an image's embedding has the same bits alone or
    batched with any others (measured on the H200: with the default workspace, rows differed at 16-176
    rows for K = 4096-10240 and 2 of 6 images changed when batched; with none, no difference, and the
    encoder's speed unchanged)."""

    def __init__(self, stream: cupy.cuda.Stream):
        self.gemm_ex = _cublas_gemm_ex()  # None where libcublas cannot be reached through ctypes
        self.capturable = self.gemm_ex is not None
        self.ptr = cublas.create()
        self.stream = stream  # held: the handle is bound to it for the handle's whole life
        cublas.setStream(self.ptr, stream.ptr)
        self._finalizer = weakref.finalize(self, cublas.destroy, self.ptr)
        set_workspace = _cublas_fn("cublasSetWorkspace_v2", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
        self.batch_invariant = set_workspace is not None and set_workspace(self.ptr, None, 0) == 0
        self.lt = None     # a gemm_lt.LtHandle once gemm_tune.tune has run
        self.algos = {}    # (n, k, out dtype, accumulate) -> [(rows, gemm_lt.Algo or None: GemmEx's pick)]
        self._problems = {}  # an exact call's key -> (gemm_lt.Problem, Algo), or None: cublasGemmEx

    def adopt(self, n, k, dtype, accumulate, picks):
        """Run (n, k, out dtype, accumulate) GEMMs with picks [(rows, Algo or None)] from now on."""
        self.algos[(n, k, np.dtype(dtype), bool(accumulate))] = sorted(picks, key=lambda p: p[0])
        self._problems.clear()  # calls looked up before (while tuning, say) choose again

    def lt_usage(self) -> tuple[int, int]:
        """(exact GEMM shapes run through cublasLt, exact shapes looked up) so far."""
        return sum(c is not None for c in self._problems.values()), len(self._problems)

    def lt_choice(self, m, n, k, lda, ldw, ldo, dtype, beta):
        """The (Problem, Algo) this call runs through cublasLt, or None: cublasGemmEx. The pick tuned for
        (n, k, out dtype, accumulate) at the row count nearest m (in ratio) decides; where cublasLt's
        heuristic does not offer its algorithm for this exact shape, the next nearest tuned one may run."""
        key = (m, n, k, lda, ldw, ldo, dtype, beta)
        if key not in self._problems:
            tuned = self.algos.get((n, k, dtype, beta == 1.0)) if beta in (0.0, 1.0) else None
            nearest = sorted(tuned or [], key=lambda t: abs(np.log2(m / t[0])))  # by the ratio of row counts
            choice = None
            if nearest and nearest[0][1] is not None:
                out_type = gemm_lt.CUDA_R_32F if dtype == np.float32 else gemm_lt.CUDA_R_16BF
                problem = gemm_lt.Problem(self.lt, m, n, k, lda, ldw, ldo, out_type)
                offered = problem.offered()  # one heuristic query for this exact shape
                for _, algo in nearest:
                    found = offered.get(bytes(algo)) if algo is not None else None
                    if found is not None:
                        choice = (problem, found)
                        break
            self._problems[key] = choice
        return self._problems[key]


def gemm(a: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray, beta: float = 0.0,
         handle: Handle | None = None) -> cupy.ndarray:
    """out = a @ w.T + beta * out. a: [M, K] bf16, w: [N, K] bf16. Runs on `handle`'s stream, or
    without one on the current stream through CuPy's handle."""
    if a.dtype != BF16 or w.dtype != BF16:
        raise TypeError(f"gemm: inputs must be bfloat16, got {a.dtype} and {w.dtype}")
    if out.dtype == BF16:
        ctype = CUDA_R_16BF
    elif out.dtype == np.float32:
        ctype = CUDA_R_32F
    else:
        raise TypeError(f"gemm: out must be bfloat16 or float32, got {out.dtype}")
    m, k = a.shape
    n, k2 = w.shape
    if k != k2 or out.shape != (m, n):
        raise ValueError(f"gemm: shapes a{a.shape} @ w{w.shape}.T -> out{out.shape} do not agree")
    if m == 0:
        return out
    lda, ldw, ldo = _rows(a, "a"), _rows(w, "w"), _rows(out, "out")
    beta_h = _ONE if beta == 1.0 else _ZERO if beta == 0.0 else np.asarray(beta, np.float32)
    # Row-major out = a w^T is column-major out^T = w a^T: cuBLAS sees w transposed, a as is.
    args = (cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, n, m, k, _ONE.ctypes.data, w.data.ptr, CUDA_R_16BF, ldw,
            a.data.ptr, CUDA_R_16BF, lda, beta_h.ctypes.data, out.data.ptr, ctype, ldo, CUBLAS_COMPUTE_32F,
            CUBLAS_GEMM_DEFAULT)
    choice = handle.lt_choice(m, n, k, lda, ldw, ldo, out.dtype, beta) if handle is not None and handle.algos \
        else None
    if choice is not None and not (a.data.ptr | w.data.ptr | out.data.ptr) % gemm_lt.ALIGNMENT:
        choice[0].run(choice[1], a.data.ptr, w.data.ptr, out.data.ptr, _ONE.ctypes.data, beta_h.ctypes.data,
                      handle.stream.ptr)  # the tuned algorithm, on the handle's stream
    elif handle is not None and handle.capturable:
        cublas.check_status(handle.gemm_ex(handle.ptr, *args))  # on the handle's own stream
    elif handle is not None:
        cublas.gemmEx(handle.ptr, *args)  # CuPy's wrapper: binds the handle to the current stream
    else:
        h = cupy.cuda.device.get_cublas_handle()
        cublas.setStream(h, cupy.cuda.get_current_stream().ptr)
        cublas.gemmEx(h, *args)
    return out
