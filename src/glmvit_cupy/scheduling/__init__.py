"""Work onto the tower, on the host:

    feed       images prepared on a thread pool, handed on in order or as they finish
    batching   images prepared against a capacity, packed into forward passes, spread over GPUs

What the commands, the service and Ray encode with (the GPU engine or the float32 reference) is
glmvit_cupy.backend: it imports the engine, which packs with batching.
"""
