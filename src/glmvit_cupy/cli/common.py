"""What glmvit-encode's images and videos share: the exit statuses, counted nouns, and the --vllm-ec-dir writes."""

from __future__ import annotations

from ..errors import OutputError
from ..output import shown
from .. import vllm_ec

# Exit statuses (docs/CLI.md#exit-status, and --help's epilog).
DONE = 0         # every input file is in the output folder, encoded by this run or an earlier one
FAILED = 1       # some input files failed (each named; the manifest's "failed"), or their --vllm-ec-dir entry
USAGE = 2        # nothing was run: the arguments, the inputs, the checkpoint, the GPU or --out refused it
WRITE = 3        # a write to the output folder or --vllm-ec-dir failed mid-run; it stopped, what was written stays
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it); what finished is saved
TERMINATED = 143   # SIGTERM (128 + 15), handled as Ctrl-C is


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread (stopped_by_sigterm) so that it stops a run as Ctrl-C does."""


def stopped_by_sigterm(signum, frame):
    raise Terminated()


def skipped(path, why) -> str:
    """The line that reports an input skipped, naming it once (the error may begin with its name too)."""
    return shown(f"skipped {path}: {str(why).removeprefix(f'{path}: ')}")


def interruption(e: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped the run, in a word, and the exit status for it."""
    return ("terminated (SIGTERM)", TERMINATED) if isinstance(e, Terminated) else ("interrupted", INTERRUPTED)

EXIT_STATUS = """exit status:
  0    every input file is in the output folder (encoded by this run or an earlier one)
  1    some input files failed, each named (and recorded in manifest.json's "failed"); the rest are
       saved. A re-run tries the failed files again, so it exits 1 again while any of them still fails.
       Also: something not the cache's own in the way of one file's --vllm-ec-dir entry (named; its
       embedding is saved in the output folder, and a re-run writes the entry once it is gone)
  2    nothing was run: a usage error or bad argument, an input that names nothing, no image or video
       found, videos without PyAV, a checkpoint that fails its checks, no usable GPU, a --vllm-ec-dir
       that cannot be written, an --out that cannot be created, is a file, was written with other
       settings, whose manifest is damaged, or that another run is writing
  3    a write failed during the run (a full disk, permissions, a mount gone: the shard, manifest or
       --vllm-ec-dir file is named); the run stopped, what it wrote stays; fix it and re-run the same
       command to resume
  130  interrupted (Ctrl-C); what finished is saved; re-run the same command to resume
  143  terminated (SIGTERM): as 130
"""


def counted(n: int, noun: str) -> str:
    """'1 image', '2 images', '0 videos'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def write_vllm(folder: str, key: str, embedding, weights: str | None, source, say) -> bool:
    """vllm_ec.write (whose own failures are OutputErrors naming the file), any other OSError from it as an
    OutputError naming --vllm-ec-dir. Something in the way of this key alone (vllm_ec.InTheWay) stops
    nothing: say(line) names `source` and why, and it returns False (the embedding is saved in --out all
    the same; a re-run writes its vLLM file once the obstacle is gone)."""
    try:
        vllm_ec.write(folder, key, embedding, weights)
        return True
    except vllm_ec.InTheWay as e:
        say(shown(f"no --vllm-ec-dir file for {source}: {e} (its embedding is saved in --out; a re-run writes "
                  "the file)"))
        return False
    except OSError as e:
        reason = e.strerror or " ".join(str(e).split())
        raise OutputError(f"cannot write {shown(key)} in --vllm-ec-dir {shown(folder)}: {shown(reason)}") from None
