"""Tools for maintainers: each module's docstring says what it measures or checks and how to run it.

    gpu_check.sh        everything the GPU machine proves in one call (tests, examples, parity, benchmarks)
    attn_trial          attention variants one subprocess each: correctness, then TFLOP/s
    ncu_graph           per kernel inside a replayed CUDA graph, under Nsight Compute
    host_share          where a small encode_pixels call's time goes, host against GPU
    video_share         where encode_video's time goes on the GPU path
    sass_loops          what a kernel's hot loops compile to (SASS), without a GPU
    softmax_numerics    the attention kernels' softmax numerics emulated in NumPy, against float64
    pingpong_protocol   the ping-pong GEMM's barrier protocol, model-checked (run by the CPU suite)
    fuzz_preprocess     random images through HF's image processor and ours (no GPU)
    fuzz_video          random videos through HF's video processor and ours (no GPU)
    fuzz_gpu_resize     random images through the GPU model, GPU resize against host resize
    video_decoders      video files read by PyAV against the reference processor's decoder
"""
