"""glmvit-serve: the tower as an HTTP service (the `serve` extra: Starlette, uvicorn, prometheus_client).

    app        the HTTP contract: /health, /v1/encode, /v1/encode_video, /metrics; validation and errors
    requests   what a request may hold, parsed and refused with the reason
    batcher    images of concurrent requests packed into shared forward passes, off the event loop
    cache      LRU of finished embeddings by content hash, within a byte budget
    metrics    the Prometheus metrics
    vllm_ec    embeddings written in vLLM's encoder-cache layout (also used by glmvit-encode)
    main       the glmvit-serve command
"""
