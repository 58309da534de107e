"""Temporary: glmvit-encode variants in fresh processes (48 and 192 files, 1024 tokens)."""
import os, sys, subprocess, tempfile, re
sys.path.insert(0, "src"); sys.path.insert(0, ".")
from benchmarks.bench_e2e import make_photos
from benchmarks.common import official_checkpoint
folder = os.path.join(tempfile.gettempdir(), "glmvit_e2e_photos")
paths = make_photos(folder, 48)
copies = []
for k in range(4):
    os.makedirs(os.path.join(folder, f"copy{k}"), exist_ok=True)
    for p in paths:
        q = os.path.join(folder, f"copy{k}", os.path.basename(p))
        if not os.path.exists(q): os.link(p, q)
        copies.append(q)
ckpt = official_checkpoint()
code = """
import sys
from glmvit_cupy import cli
mode = sys.argv[1]
if mode == 'numpy':
    real = cli.Backend.__init__
    def init(self, *a, **k):
        real(self, *a, **k); self.host_buffer = None
    cli.Backend.__init__ = init
sys.exit(cli.main(sys.argv[2:]))
"""
for mode in ("lent", "numpy"):
    for label, files in (("48", paths), ("192", copies)):
        with tempfile.TemporaryDirectory() as out:
            r = subprocess.run([sys.executable, "-c", code, mode, *files, "--checkpoint", ckpt, "--out", out,
                                "--max-image-tokens", "1024"], capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
            m = re.search(r"\(([\d.]+) images/s", r.stdout + r.stderr)
            print(mode, label, m.group(1) if m else r.stderr[-500:], flush=True)
