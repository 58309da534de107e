"""Inputs made exactly as the reference processors make them (HF transformers 5.23.0's
Glm5NextImageProcessorPil and its video processor), on the host:

    decode        a path, file object, bytes, PIL image or array -> RGB, as the reference loads it
    image         the image processor: smart_resize, the canvas, normalise and patchify (preprocess)
    resample      Pillow's and ATen's BICUBIC as coefficient tables (shared with the GPU resize)
    gpu_decode    opt-in JPEG decoding by nvImageCodec (the gpu-decode extras)
    video_files   a video's frames: decoded arrays, frame image files, or a video file through PyAV
    video         the video processor: frame sampling, one canvas per video, temporal groups
"""
