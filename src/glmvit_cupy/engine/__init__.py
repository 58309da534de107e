"""The GPU engine (CuPy). Read in this order:

    kernels     the registry: cuda/*.cu compiled with cupy.RawModule, kernels fetched by name
    gemm        cuBLAS BF16 GEMMs (bf16 or float32 out) on a handle bound to one stream
    gemm_lt     cublasLt through ctypes: the same GEMM with an algorithm of our choosing
    gemm_tune   at load: per GEMM shape, the fastest cublasLt algorithm with cuBLAS's default bits
    attention   flash attention's variant table and the heuristics that pick one per input shape
    launch      what the launchers share: grid arithmetic, shared-memory opt-in, the tracing hook
    tensor_maps TMA tensor maps (cuTensorMapEncodeTiled through ctypes) for the Hopper kernels
    ops         one typed launcher per kernel entry (grid, block and argument order written once)
    gemm_sm90   the launchers of our own Hopper GEMM with the SwiGLU in its epilogue (gemm_sm90.cu)
    params      the weights uploaded to one GPU, named after the checkpoint
    arena       scratch: one allocation, sized once from the capacity, in named slots
    budgets     token budgets, and a batch's positions, segments and attention tiles for one (NumPy)
    plans       per budget: those on the GPU, the attention variant, the CUDA graph
    layers      the forward, top-down, one function per sub-layer (mirrors reference.py)
    pools       pools of page-locked and device memory blocks, reused once idle
    uploads     decoded images copied to the GPU by the threads that decode them (one GPU)
    staging     inputs into the arena: their uploads, the resize + patchify on the GPU
    runner      one GPU's forwards: stream, cuBLAS handle, lock, arena, plans, CUDA graphs, out-of-memory
    model       GlmVit: the public facade (from_checkpoint, encode, encode_pixels, encode_video, precapture)
    replicas    Replicas: one GlmVit per GPU, work spread across them
"""
