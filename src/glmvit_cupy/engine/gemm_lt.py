"""cublasLt through ctypes: the same product as gemm.py's cublasGemmEx, out[M, N] (+)= a[M, K] @ w[N, K]^T,
with an algorithm chosen by the caller (gemm_tune.py) instead of cuBLAS's default pick.

Why: for the tower's narrow GEMMs cuBLAS's default pick leaves speed behind (attn.proj, N = K = 1,024
accumulated into fp32: 429 TFLOP/s at 16,384 rows against 546 for one of cublasLt's own heuristic
candidates, with the same bits; H200, docs/PERFORMANCE.md). Only algorithms that need no workspace and
do not split K are offered (`candidates`), so a row's sum never depends on the rows launched with it.

Layouts are column-major as cuBLAS sees the row-major product: A = w (K x N, transposed), B = a (K x M),
C = D = out (N x M). Every call takes the stream explicitly, so Lt calls can be captured in CUDA graphs.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F, CUBLAS_OP_N, CUBLAS_OP_T = 14, 0, 68, 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4   # cublasLtMatmulDescAttributes_t
_PREF_MAX_WORKSPACE_BYTES = 1       # cublasLtMatmulPreferenceAttributes_t
_CONFIG_SPLITK_NUM = 2              # cublasLtMatmulAlgoConfigAttributes_t
ALIGNMENT = 256                     # bytes: the heuristic's default minimum alignment of every pointer


class Algo(ctypes.Structure):  # cublasLtMatmulAlgo_t: opaque, 64 bytes
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t: 96 bytes
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"cublasLt: {what} failed with cublasStatus {status}")


def loaded_paths(prefix: str) -> list[str]:
    """The files of the shared libraries this process has loaded whose name starts with `prefix` (e.g.
    "libcublas.so"), sorted; [] where /proc/self/maps cannot be read. How gemm.py reaches the libcublas
    CuPy loaded, and this module its libcublasLt."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({ln.split()[-1] for ln in f if ln.rstrip().split("/")[-1].startswith(prefix)})
    except OSError:
        return []


@functools.cache
def library():
    """libcublasLt as this process loaded it (libcublas, which CuPy loads, depends on it), its functions
    typed; None where it cannot be found (gemm.py then keeps cublasGemmEx)."""
    paths = loaded_paths("libcublasLt.so")
    try:
        lib = ctypes.CDLL(paths[0]) if paths else None
    except OSError:
        return None
    if lib is None:
        return None
    p, i, sz, u64, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int64
    try:
        for name, args in (("cublasLtCreate", [p]), ("cublasLtDestroy", [p]),
                           ("cublasLtMatmulDescCreate", [p, i, i]), ("cublasLtMatmulDescDestroy", [p]),
                           ("cublasLtMatmulDescSetAttribute", [p, i, p, sz]),
                           ("cublasLtMatrixLayoutCreate", [p, i, u64, u64, i64]), ("cublasLtMatrixLayoutDestroy", [p]),
                           ("cublasLtMatmulPreferenceCreate", [p]), ("cublasLtMatmulPreferenceDestroy", [p]),
                           ("cublasLtMatmulPreferenceSetAttribute", [p, i, p, sz]),
                           ("cublasLtMatmulAlgoGetHeuristic", [p, p, p, p, p, p, p, i, p, p]),
                           ("cublasLtMatmulAlgoConfigGetAttribute", [p, i, p, sz, p]),
                           ("cublasLtMatmul", [p, p, p, p, p, p, p, p, p, p, p, p, p, p, sz, p])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int  # 64-bit sizes passed at their width
    except AttributeError:
        return None
    return lib


class LtHandle:
    """A cublasLt handle (not bound to a stream: each matmul names its own)."""

    def __init__(self, lib):
        self.lib = lib
        self.ptr = ctypes.c_void_p()
        _check(lib.cublasLtCreate(ctypes.byref(self.ptr)), "cublasLtCreate")
        self._finalizer = weakref.finalize(self, lib.cublasLtDestroy, self.ptr)


class Problem:
    """One GEMM shape's descriptors: m rows of a (leading dimension lda), w [n, k] (ldw), out [m, n] (ldo)
    bf16 or fp32 (`out_type`), fp32 accumulation."""

    def __init__(self, lt: LtHandle, m, n, k, lda, ldw, ldo, out_type):
        lib, p = lt.lib, ctypes.c_void_p
        self.lt, self.desc, self.la, self.lb, self.lc = lt, p(), p(), p(), p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "DescCreate")
        self._finalizers = [weakref.finalize(self, lib.cublasLtMatmulDescDestroy, self.desc)]
        for attr, op in ((_DESC_TRANSA, CUBLAS_OP_T), (_DESC_TRANSB, CUBLAS_OP_N)):
            v = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "DescSetAttribute")
        for layout, t, rows, cols, ld in ((self.la, CUDA_R_16BF, k, n, ldw), (self.lb, CUDA_R_16BF, k, m, lda),
                                          (self.lc, out_type, n, m, ldo)):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), t, ctypes.c_uint64(rows),
                                                  ctypes.c_uint64(cols), ctypes.c_int64(ld)), "MatrixLayoutCreate")
            self._finalizers.append(weakref.finalize(self, lib.cublasLtMatrixLayoutDestroy, layout))

    def candidates(self, count: int = 32) -> list[Algo]:
        """cublasLt's heuristic algorithms for this shape that need no workspace and do not split K, best
        first as the heuristic ranks them."""
        lib = self.lt.lib
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        try:
            zero = ctypes.c_size_t(0)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(zero),
                                                            ctypes.sizeof(zero)), "PreferenceSetAttribute")
            results, got = (_Heuristic * count)(), ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(self.lt.ptr, self.desc, self.la, self.lb, self.lc, self.lc,
                                                      pref, count, results, ctypes.byref(got)), "AlgoGetHeuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        return [r.algo for r in results[:got.value]
                if r.state == 0 and r.workspaceSize == 0 and _split_k(lib, r.algo) in (0, 1)]  # 0: default, 1

    def offered(self) -> dict[bytes, Algo]:
        """This shape's candidates by their configuration's bytes (kernel, tile, stages, swizzle, ...):
        where an algorithm chosen at another row count is offered here, it is offered[bytes(algo)].
        (cublasLtMatmulAlgoCheck is not used: on the H200 it refused algorithms that run, even at the
        very shape they were found for.)"""
        return {bytes(c): c for c in self.candidates()}

    def run(self, algo: Algo, a_ptr, w_ptr, out_ptr, alpha_ptr, beta_ptr, stream_ptr):
        """out = alpha * a @ w^T + beta * out on `stream_ptr` (alpha, beta: host float32 scalars)."""
        _check(self.lt.lib.cublasLtMatmul(self.lt.ptr, self.desc, alpha_ptr, w_ptr, self.la, a_ptr, self.lb, beta_ptr,
                                          out_ptr, self.lc, out_ptr, self.lc, ctypes.byref(algo), None,
                                          ctypes.c_size_t(0), stream_ptr), "Matmul")


def _split_k(lib, algo: Algo) -> int:
    v, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
    _check(lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), _CONFIG_SPLITK_NUM, ctypes.byref(v), 4,
                                                    ctypes.byref(written)), "AlgoConfigGetAttribute")
    return int(v.value)
