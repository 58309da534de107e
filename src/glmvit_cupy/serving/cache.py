"""Finished embeddings by content: an LRU within a byte budget. A hit skips decoding and the GPU."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class EmbeddingCache:
    """{(sha256 of the image bytes, min_image_tokens, max_image_tokens, checkpoint): (embedding, grid)} and
    {(video key, checkpoint): (embedding, its metadata)}. Used from the event loop only (no lock needed)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self._entries: OrderedDict = OrderedDict()

    def __len__(self):
        return len(self._entries)

    def get(self, key):
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
        return hit

    def put(self, key, embedding: np.ndarray, about):
        if key in self._entries or embedding.nbytes > self.max_bytes:
            return
        self._entries[key] = (embedding, about)
        self.bytes += embedding.nbytes
        while self.bytes > self.max_bytes:
            _, (old, _) = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
