"""glmvit-serve: the tower as an HTTP service (the `serve` extra: Starlette, uvicorn, prometheus_client).

    app        the HTTP contract: /health, /v1/encode, /v1/encode_video, /metrics; validation and errors
    requests   what a request may hold, parsed and refused with the reason
    decoding   what a request's images and videos hold before they are decoded, and their decoding
    batcher    images of concurrent requests packed into shared forward passes, off the event loop
    flights    the same content in flight encoded once; work nobody waits for dropped
    cache      LRU of finished embeddings by content hash, within a byte limit
    metrics    the Prometheus metrics (summed over every process where there are HTTP workers)
    http_server  uvicorn with the connection cap, the deadlines and the two-step stop
    workers    --workers N: HTTP worker processes beside the engine process, and their supervision
    engine_server  the engine process's side: the tower fed by the workers
    remote     a worker's side: the engine in another process, as the app's backend and batcher
    wire       the frames between them: a pickled header, the arrays' bytes beside it
    main       the glmvit-serve command

command() here is the console script's entry point: it imports the command where Ctrl-C meets a handler, not
a traceback, as glmvit_cupy.cli.command does for glmvit-encode.
"""

import sys

INTERRUPTED = 130  # what main.main returns on Ctrl-C while starting


def command(argv=None) -> int:
    """glmvit-serve (main.main), imported here."""
    try:
        from .main import main
    except KeyboardInterrupt:  # while the command imports, before main's own handler
        print("\nglmvit-serve: interrupted while starting (exit 130)", file=sys.stderr)
        return INTERRUPTED
    return main(argv)
