"""Every error a user of glmvit-cupy can meet, in one place and importable without CuPy.

The input errors are ValueErrors, so callers who only know "bad input" still catch them; the GPU's
are a MemoryError and a RuntimeError. Each message names what was wrong, where, and what would be
right.
"""


class CheckpointError(ValueError):
    """A checkpoint (config.json, index or safetensors shard) cannot be used.

    The message names the file and, where there is one, the tensor.
    """


class NoVisionConfig(CheckpointError):
    """config.json describes a text-only model (no vision_config)."""


class AbsentTower(CheckpointError):
    """config.json declares a vision tower but the shards hold none of it."""


class ImageError(ValueError):
    """An image cannot be decoded or is not an image the tower can encode.

    The message names the image (its path, or its position in the call).
    """


class _Advised:
    """An error said as `what` was wrong and `advice`, what the caller can change, in the caller's own terms
    (ADVICE: the Python API's): a command rewords the advice for its options (advised)."""

    ADVICE = ""

    def __init__(self, what: str, advice: str | None = None):
        advice = self.ADVICE if advice is None else advice
        super().__init__(f"{what}; {advice}")
        self.what, self.advice = what, advice

    def __reduce__(self):  # pickled (a process pool, Ray) as what and advice, not the joined message
        return type(self), (self.what, self.advice)

    def within(self, name: str):
        """The same error, said of `name` (the video)."""
        return type(self)(f"{name}: {self.what}", self.advice)

    def advised(self, advice: str):
        return type(self)(self.what, advice)


class TooShort(_Advised, ValueError):
    """A video too short to sample any frame at the target rate. `what` says so; `advice`, what the caller can
    change, in the caller's own terms: a command rewords it for its options (advised)."""

    ADVICE = "raise target_fps or pass sample=False to encode the frames as given"


class Untimed(_Advised, ImageError):
    """A video file whose packets span no time (all at one timestamp, or none with one): its fps cannot be read
    from it. `what` says so; `advice`, what the caller can give instead: a command without a video's own fps
    rewords it (advised), REMUX being what mends the file."""

    ADVICE = "give its fps (fps= or duration=) to read it"
    REMUX = ("give the file timestamps at its frame rate FPS, its frames copied as they are (FFmpeg 4.4 or later): "
             "ffmpeg -i IN -c copy -bsf:v 'setts=ts=N/(FPS*TB):duration=1/(FPS*TB)' OUT.mkv")


class OutputError(ValueError):
    """A glmvit-encode output folder cannot be used as asked (a file in its place, an unreadable manifest,
    other settings than the run that wrote it); the message says what to do."""


class GpuOutOfMemory(MemoryError):
    """The GPU ran out of memory; the model is still usable (encode fewer tokens per call)."""


class GpuUnavailable(RuntimeError):
    """The GPU engine cannot run here: no CuPy, no CUDA GPU or driver, or no cuBLAS / NVRTC. The message
    says which and what to install; the float32 reference (glmvit_cupy.reference) needs none of them."""


class KernelError(RuntimeError):
    """A kernel module or entry does not exist, or a module failed to compile."""


class ServerError(RuntimeError):
    """glmvit-serve refused or failed a request (glmvit_cupy.client): .status (HTTP), .error (the
    server's reason), .index (the image or video it names, or None), .source (what the caller gave
    for it: a path, or None)."""

    def __init__(self, status: int, error: str, index: int | None = None, source: str | None = None):
        super().__init__(f"HTTP {status}: {error}" + (f" [{source}]" if source is not None else ""))
        self.status, self.error, self.index, self.source = status, error, index, source


def quoted(v, width: int = 40) -> str:
    """repr(v) as an error message quotes it: at most `width` characters and a count of the rest (a value
    a request sent can be megabytes long), and an integer too long for repr as its size in bits."""
    try:
        r = repr(v)
    except ValueError:  # an int past Python's digit limit for str(), or a list or tuple holding one
        if isinstance(v, int):
            return f"an integer of {v.bit_length():,} bits"
        if not isinstance(v, (list, tuple)):
            return f"a {type(v).__name__} too large to print"
        ends = "()" if isinstance(v, tuple) else "[]"
        r = ends[0] + ", ".join(quoted(x, width) for x in v[:16]) + (", ..." if len(v) > 16 else "") + ends[1]
    return r if len(r) <= width else f"{r[:width]}... ({len(r):,} characters)"
