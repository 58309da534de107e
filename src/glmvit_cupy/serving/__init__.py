"""glmvit-serve: the tower as an HTTP service (the `serve` extra: Starlette, uvicorn, prometheus_client).

    app        the HTTP contract: /health, /v1/encode, /v1/encode_video, /metrics; validation and errors
    requests   what a request may hold, parsed and refused with the reason
    decoding   what a request's images and videos hold before they are decoded, and their decoding
    batcher    images of concurrent requests packed into shared forward passes, off the event loop
    flights    the same content in flight encoded once; work nobody waits for dropped
    cache      LRU of finished embeddings by content hash, within a byte limit
    metrics    the Prometheus metrics
    main       the glmvit-serve command
"""
