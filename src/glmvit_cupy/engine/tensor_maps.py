"""TMA tensor maps (CUtensorMap) for the Hopper kernels, encoded on the host through the CUDA driver.

A map describes a 2-D bf16 array (its shape, its rows' stride in bytes) and the box one
TMA copy moves (64 columns x `box_rows` rows, 128B-swizzled as wgmma's descriptors read it). Kernels take
it by value as a __grid_constant__ parameter (cuda/tma.cuh), so a captured CUDA graph holds its own
copy and nothing is uploaded. Encoding is host work only (no stream, safe inside a capture); maps are
cached by (address, shape, stride, box), since the engine asks for the same arena slices and weights
on every forward.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import OrderedDict

import numpy as np

from ..errors import KernelError

MAP_DTYPE = np.dtype([("words", np.uint64, (16,))])  # CUtensorMap: 128 opaque bytes, 64-byte aligned
_UINT16 = 1           # CU_TENSOR_MAP_DATA_TYPE_UINT16: bf16 moved as its bits
_SWIZZLE_128B = 3     # CU_TENSOR_MAP_SWIZZLE_128B
_L2_PROMOTE_256B = 3  # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
BOX_COLS = 64         # 128 bytes of bf16: the 128B swizzle's row
_CACHE_SIZE = 4096
_cache: OrderedDict = OrderedDict()
_lock = threading.Lock()  # models on several threads (replicas, the server) share the cache


@functools.cache
def _encode_fn():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
    except (OSError, AttributeError) as e:
        raise KernelError(f"TMA tensor maps need the CUDA driver's cuTensorMapEncodeTiled (CUDA 12+): {e}") from None
    p, u32 = ctypes.c_void_p, ctypes.c_uint32
    fn.argtypes = [p, ctypes.c_int, u32, p, p, p, p, p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def tensor_map(array, box_rows: int) -> np.void:
    """The tensor map of a 2-D bf16 CuPy array (contiguous rows, 16-byte aligned start and stride) with
    boxes of 64 columns x box_rows rows; rows and columns past its end read as zeros."""
    rows, cols = array.shape
    stride = array.strides[0]
    key = (array.data.ptr, rows, cols, stride, box_rows)
    with _lock:
        m = _cache.get(key)
        if m is not None:
            _cache.move_to_end(key)
            return m
    if array.strides[1] != 2 or stride % 16 or array.data.ptr % 16 or not (0 < box_rows <= 256):
        raise ValueError(f"tensor_map: a bf16 array with contiguous rows, 16-byte aligned start and row stride "
                         f"is needed (shape {array.shape}, strides {array.strides}, box rows {box_rows})")
    buf = np.zeros(MAP_DTYPE.itemsize + 64, np.uint8)  # the driver writes a 64-byte aligned CUtensorMap
    off = -buf.ctypes.data % 64
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(stride)
    box = (ctypes.c_uint32 * 2)(BOX_COLS, box_rows)
    steps = (ctypes.c_uint32 * 2)(1, 1)
    err = _encode_fn()(buf.ctypes.data + off, _UINT16, 2, array.data.ptr, dims, strides, box, steps, 0,
                       _SWIZZLE_128B, _L2_PROMOTE_256B, 0)
    if err != 0:
        raise KernelError(f"cuTensorMapEncodeTiled failed (CUresult {err}) for shape {array.shape}, strides "
                          f"{array.strides}, box {BOX_COLS} x {box_rows}")
    m = np.frombuffer(buf[off:off + MAP_DTYPE.itemsize].tobytes(), MAP_DTYPE)[0]
    with _lock:
        _cache[key] = m
        if len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return m
