"""glmvit-serve's decoding in processes of its own (serving/decoding.py's OffProcess): a decode cut short by
the server's shutdown is refused with 503, never as a bad image, and the decoding processes end with the
server however it ends."""

import io
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from PIL import Image, features

from glmvit_cupy.serving.decoding import OffProcess
from glmvit_cupy.serving.requests import Refused

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

pytestmark = pytest.mark.skipif(not features.check("jpg_2000"), reason="this Pillow has no JPEG 2000 codec")


def jpeg_2000(h: int, w: int) -> bytes:
    """A JPEG 2000 file (a format decoded off the server's process) of random pixels."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(h * w).integers(0, 256, (h, w, 3), np.uint8)).save(buf, "JPEG2000")
    return buf.getvalue()


def test_a_decode_cut_short_by_shutdown_is_refused_with_503_and_so_is_every_later_one():
    data = jpeg_2000(2000, 2000)  # its decode, with the process's start, takes well over the 0.3 s below
    off = OffProcess(1)
    got = []

    def ask():
        try:
            got.append(off(data, "image 0", None))
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=ask)
    t.start()
    time.sleep(0.3)
    off.shutdown()
    t.join(30)
    assert len(got) == 1 and isinstance(got[0], Refused), got
    assert got[0].status == 503 and "image 0" in got[0].error and "shutting down" in got[0].error
    with pytest.raises(Refused) as e:
        off(jpeg_2000(16, 16), "image 1", None)
    assert e.value.status == 503 and "image 1" in e.value.error


def test_the_decoding_processes_end_when_the_server_is_killed():
    """The server process, holding a decoding process, dies by SIGKILL (no handler runs): the decoding
    process ends within seconds instead of living on."""
    code = textwrap.dedent(f"""
        import io, os, signal, sys
        sys.path.insert(0, {SRC!r})
        import numpy as np
        from PIL import Image
        from glmvit_cupy.serving.decoding import OffProcess
        buf = io.BytesIO()
        Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(buf, "JPEG2000")
        off = OffProcess(1)
        assert off(buf.getvalue(), "a", None).shape == (16, 16, 3)
        print(*off._pool._processes, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1, proc.stdout

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    still = alive(pids[0])
    if still:
        os.kill(pids[0], 9)
    assert not still, "the decoding process outlived the server"


def test_a_decode_refused_by_shutdown_passes_through_the_decoder_as_503():
    """The offload's Refused (503) reaches the request as it is through decode.load, not as a damaged file."""
    from glmvit_cupy.preprocessing import decode

    off = OffProcess(1)
    off.shutdown()
    saved, decode.offload = decode.offload, off
    try:
        with pytest.raises(Refused) as e:
            decode.load(jpeg_2000(16, 16), "image 0")
    finally:
        decode.offload = saved
    assert e.value.status == 503 and "shutting down" in e.value.error
