"""The two errors a user can cause: a bad checkpoint and a bad image.

Both are ValueErrors so that callers who only know "bad input" still catch them.
"""


class CheckpointError(ValueError):
    """A checkpoint (config.json, index or safetensors shard) cannot be used.

    The message names the file and, where there is one, the tensor.
    """


class ImageError(ValueError):
    """An image cannot be decoded or is not an image the tower can encode.

    The message names the image (its path, or its position in the call).
    """
