"""glmvit-encode: files, folders and globs -> embeddings in safetensors shards and a manifest.

    main      the command: arguments, the images' pipeline, the summary
    common    exit statuses, stdout and stderr, the lines that report a skipped input, the vLLM files it writes
    inputs    inputs expanded into files; images read, hashed and prepared on threads
    videos    video files: read on threads, encoded on a free GPU lane, written as they finish

command() here is the console script's entry point: it imports the command (NumPy, Pillow, the checkpoint
loader: a second or more from a cold disk) where Ctrl-C meets a handler, not a traceback.
"""

import sys

INTERRUPTED = 130  # common.INTERRUPTED, which imports what this module must not yet


def command(argv=None) -> int:
    """glmvit-encode (main.main), imported here."""
    try:
        from .main import main
    except KeyboardInterrupt:  # while the command imports, before its own handlers
        print("\nglmvit-encode: interrupted before anything was encoded", file=sys.stderr)
        return INTERRUPTED
    return main(argv)
