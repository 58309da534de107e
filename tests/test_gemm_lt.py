"""engine/gemm_lt.py's library lookup, without a GPU: gemm.py (libcublas) and gemm_lt.py (libcublasLt)
find the libraries CuPy loaded through it."""

import ctypes
import ctypes.util

from glmvit_cupy.engine.gemm_lt import loaded_paths


def test_loaded_paths_lists_only_libraries_this_process_loaded():
    ctypes.CDLL(ctypes.util.find_library("m"))  # libm: loaded now, if it was not already
    paths = loaded_paths("libm.so")
    assert paths and all(p.split("/")[-1].startswith("libm.so") for p in paths)
    assert loaded_paths("libglmvit-no-such-library.so") == []
