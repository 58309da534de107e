"""glmvit-serve: the tower as an HTTP service (the `serve` extra: Starlette, uvicorn, prometheus_client).

    app       the HTTP contract: /health, /v1/encode, /metrics; validation and errors
    batcher   images of concurrent requests packed into shared forward passes, off the event loop
    cache     LRU of finished embeddings by content hash, within a byte budget
    metrics   the Prometheus metrics
    main      the glmvit-serve command
"""
