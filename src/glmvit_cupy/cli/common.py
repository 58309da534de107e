"""What glmvit-encode's images and videos share: the exit statuses, stdout and stderr, counted nouns, and the
--vllm-ec-dir writes."""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading

from ..errors import OutputError
from ..output import shown
from .. import vllm_ec

# Exit statuses (docs/CLI.md#exit-status, and --help's epilog).
DONE = 0         # every input file is in the output folder, encoded by this run or an earlier one
FAILED = 1       # some input files failed (each named; the manifest's "failed"), or their --vllm-ec-dir entry
USAGE = 2        # nothing was run: the arguments, the inputs, the checkpoint, the GPU or --out refused it
WRITE = 3        # a write to the output folder or --vllm-ec-dir failed mid-run; it stopped, what was written stays
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it); what finished is saved
OUTPUT_GONE = 141  # stdout's or stderr's reader went away (a broken pipe: `| head`; 128 + SIGPIPE), as Ctrl-C
TERMINATED = 143   # SIGTERM (128 + 15), handled as Ctrl-C is


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread (stopped_by_sigterm) so that it stops a run as Ctrl-C does."""


def stopped_by_sigterm(signum, frame):
    raise Terminated()


class Disconnected(KeyboardInterrupt):
    """The reader of stdout or stderr went away (a broken pipe), raised in the main thread (Streams) so that it
    stops a run as Ctrl-C does."""


class Streams:
    """sys.stdout and sys.stderr while the command runs (a context manager), so that neither ends it in a
    traceback. One closed from the start (`>&-`) is os.devnull, its descriptor too (no file the run opens takes
    that number, where a library's own messages would land in it): the run goes on, saying nothing there. One
    whose reader goes away (a broken pipe: `| head -1` has its line) is os.devnull from then on, so that nothing
    said after it fails, nor Python's flush at exit, and the run stops as Ctrl-C stops it: Disconnected, raised
    in the main thread by SIGPIPE's handler (installed while the command runs there) whichever thread was
    writing (the writer thread's batch is saved all the same); in another thread, by flush() at the end. One
    that cannot be written (a full disk under `> log`, an I/O error) is os.devnull from then on and stops
    nothing: the other stream says so at the end. A character the stream's encoding lacks (a file name in an
    ASCII locale) is written as a backslash escape."""

    def __init__(self):
        self.gone = False  # a reader went away
        self._stopped = False  # Disconnected raised: once
        self._armed, self._previous = False, None

    def __enter__(self):
        self._saved = sys.stdout, sys.stderr
        self._errors = []
        for stream in self._saved:  # a name its encoding lacks is escaped, not a UnicodeEncodeError mid-run
            with contextlib.suppress(AttributeError, ValueError, OSError):  # not a text file (a caller's capture)
                self._errors.append((stream, stream.errors))
                stream.reconfigure(errors="backslashreplace")
        self._guarded = [_Guarded(sys.stdout, 1, self, "stdout"), _Guarded(sys.stderr, 2, self, "stderr")]
        sys.stdout, sys.stderr = self._guarded
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGPIPE, self._on_sigpipe)
            self._armed = True
        return self

    def __exit__(self, *exc):
        if self._armed:  # first: a reader gone from here on stops nothing
            self._armed = False
            signal.signal(signal.SIGPIPE, self._previous)
        for stream in self._guarded:
            stream.flush()
        for stream, other in zip(self._guarded, self._guarded[::-1]):
            if stream.failure is not None:
                print(f"glmvit-encode: {stream.name} could not be written ({stream.failure}); what was left to say "
                      "there is lost (the run's work is as its exit status says)", file=other)
                other.flush()
        for stream in self._guarded:
            stream.close_devnull()
        sys.stdout, sys.stderr = self._saved
        for stream, errors in self._errors:
            with contextlib.suppress(AttributeError, ValueError, OSError):
                stream.reconfigure(errors=errors)

    def went_away(self):
        """A stream's reader went away: the run stops (in the main thread, through SIGPIPE's handler)."""
        if not self.gone:
            self.gone = True
            if self._armed:
                _thread.interrupt_main(signal.SIGPIPE)

    def _on_sigpipe(self, signum, frame):
        if self.gone:  # else a pipe not ours (a download's socket): its write fails, as when SIGPIPE is ignored
            self.stop()

    def stop(self):
        if not self._stopped:
            self._stopped = True
            raise Disconnected()

    def flush(self):
        """Flush both streams (what a pipe's buffer holds: its reader gone shows here at the latest); Disconnected
        if a reader went away and the run has not stopped for it yet."""
        for stream in self._guarded:
            stream.flush()
        if self.gone:
            self.stop()


class _Guarded:
    """One of Streams' streams: what is written goes to `stream` until a write finds its reader gone, then to
    os.devnull (and so does `stream`'s own descriptor, where Python flushes what it still buffers at exit)."""

    _stream = None

    def __init__(self, stream, fd: int, streams: Streams, name: str):
        self._streams, self._null, self.name = streams, None, name
        self.failure = None  # the error that made it unwritable (not a reader gone)
        if stream is None:  # Python's stand-in for a descriptor closed from the start (or a caller's choice)
            if _closed(fd):
                _to_devnull(fd)
            stream = self._null = open(os.devnull, "w")
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
        except OSError as e:
            self._failed(e)
        return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()
        except OSError as e:
            self._failed(e)

    def __getattr__(self, name):  # encoding, fileno, isatty: the stream's
        return getattr(self._stream, name)

    def _gone(self):
        self._to_devnull()
        self._streams.went_away()

    def _failed(self, e: OSError):
        self.failure = self.failure or e
        self._to_devnull()

    def _to_devnull(self):
        """From now on to os.devnull, and so is the stream's descriptor (where Python flushes its buffer at exit)."""
        with contextlib.suppress(OSError, ValueError):  # a stream of no descriptor (a test's capture)
            _to_devnull(self._stream.fileno())
        self._stream = self._null = self._null or open(os.devnull, "w")

    def close_devnull(self):
        if self._null is not None:
            self._null.close()


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def _to_devnull(fd: int) -> None:
    """Descriptor `fd` opened on os.devnull (closed, or not, before)."""
    null = os.open(os.devnull, os.O_WRONLY)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)


def skipped(path, why) -> str:
    """The line that reports an input skipped, naming it once (the error may begin with its name too)."""
    return shown(f"skipped {path}: {str(why).removeprefix(f'{path}: ')}")


def interruption(e: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped the run, in a word, and the exit status for it."""
    if isinstance(e, Disconnected):
        return "stopped: the reader of its output went away (a broken pipe)", OUTPUT_GONE
    return ("terminated (SIGTERM)", TERMINATED) if isinstance(e, Terminated) else ("interrupted", INTERRUPTED)

EXIT_STATUS = """exit status:
  0    every input file is in the output folder (encoded by this run or an earlier one)
  1    some input files failed, each named (and recorded in manifest.json's "failed"); the rest are
       saved. A re-run tries the failed files again, so it exits 1 again while any of them still fails.
       Also: something not the cache's own in the way of one file's --vllm-ec-dir entry, or its folder
       this user may not write (named; its embedding is saved in the output folder, and a re-run writes
       the entry once it is gone)
  2    nothing was run: a usage error or bad argument, an input that names nothing, no image or video
       found, videos without PyAV, a checkpoint that fails its checks, no usable GPU, a --vllm-ec-dir
       that cannot be written, an --out that cannot be created, is a file, was written with other
       settings, whose manifest is damaged, or that another run is writing
  3    a write failed during the run (a full disk, permissions, a mount gone: the shard, manifest or
       --vllm-ec-dir file is named); the run stopped, what it wrote stays; fix it and re-run the same
       command to resume
  130  interrupted (Ctrl-C); what finished is saved; re-run the same command to resume
  141  the reader of stdout or stderr went away (a broken pipe: `| head`): as 130 (a stream closed from the
       start, `>&-`, is no error: the run goes on, saying nothing there; nor is one that cannot be written,
       a full disk under `> log`: its lines are dropped and the other stream says so at the end)
  143  terminated (SIGTERM): as 130
"""


def counted(n: int, noun: str) -> str:
    """'1 image', '2 images', '0 videos'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def no_vllm_file(source, e) -> str:
    """The line that names a file whose --vllm-ec-dir entry something not the cache's own keeps from being
    written (vllm_ec.InTheWay `e`)."""
    return shown(f"no --vllm-ec-dir file for {source}: {e} (its embedding is saved in --out; a re-run writes the file)")


def write_vllm(folder: str, key: str, embedding, weights: str | None, source, say) -> bool:
    """vllm_ec.write (whose own failures are OutputErrors naming the file), any other OSError from it as an
    OutputError naming --vllm-ec-dir. Something in the way of this key alone (vllm_ec.InTheWay) stops
    nothing: say(line) names `source` and why, and it returns False (the embedding is saved in --out all
    the same; a re-run writes its vLLM file once the obstacle is gone)."""
    try:
        vllm_ec.write(folder, key, embedding, weights)
        return True
    except vllm_ec.InTheWay as e:
        say(no_vllm_file(source, e))
        return False
    except OSError as e:
        reason = e.strerror or " ".join(str(e).split())
        raise OutputError(f"cannot write {shown(key)} in --vllm-ec-dir {shown(folder)}: {shown(reason)}") from None
