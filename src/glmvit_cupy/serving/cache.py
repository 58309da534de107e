"""Finished embeddings by content: an LRU within a byte limit. A hit skips decoding and the GPU."""

from __future__ import annotations

import sys
from collections import OrderedDict

import numpy as np

ENTRY_OVERHEAD = 64  # the dictionary's slot and order node for one entry (CPython's OrderedDict, measured)


def held_bytes(obj) -> int:
    """The bytes `obj` keeps alive, an honest estimate: an array's header and data (a view's whole base), a
    tuple, list or dict with what it holds, anything else its own size."""
    if isinstance(obj, np.ndarray):
        if obj.base is None:
            return sys.getsizeof(obj)  # its data included
        root = obj
        while isinstance(root.base, np.ndarray):
            root = root.base
        return sys.getsizeof(obj) + (root.nbytes if root is not obj else obj.nbytes)
    if isinstance(obj, (tuple, list)):
        return sys.getsizeof(obj) + sum(held_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sys.getsizeof(obj) + sum(held_bytes(k) + held_bytes(v) for k, v in obj.items())
    return sys.getsizeof(obj)


class EmbeddingCache:
    """{(sha256 of the image bytes, min_image_tokens, max_image_tokens, checkpoint): (embedding, grid)} and
    {(video key, checkpoint): (embedding, its metadata)}. Used from the event loop only (no lock needed).

    An entry counts what it holds: the embedding array (its header too, and the whole buffer a view keeps
    alive), its metadata, its key and the dictionary's slot; the key's last part, the checkpoint, is one
    string shared by every entry and counted once nowhere (it lives in the settings)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self._entries: OrderedDict = OrderedDict()  # key -> (embedding, about, bytes counted)

    def __len__(self):
        return len(self._entries)

    def get(self, key):
        hit = self._entries.get(key)
        if hit is None:
            return None
        self._entries.move_to_end(key)
        return hit[0], hit[1]

    @staticmethod
    def entry_bytes(key, embedding: np.ndarray, about) -> int:
        own_key = sys.getsizeof(key) + sum(held_bytes(k) for k in key[:-1])
        return ENTRY_OVERHEAD + own_key + held_bytes(embedding) + held_bytes(about) + sys.getsizeof((None, None, 0))

    def put(self, key, embedding: np.ndarray, about):
        if key in self._entries:
            return
        if isinstance(embedding, np.ndarray) and embedding.base is not None:
            # A view (one of a pass's or a video request's embeddings split from one array) would keep the whole
            # array alive, and be counted so for each entry: 400 videos of one request once counted 1 GB for
            # 3.3 MB of embeddings and emptied the cache. The entry keeps its own rows.
            embedding = embedding.copy()
        size = self.entry_bytes(key, embedding, about)
        if size > self.max_bytes:
            return
        self._entries[key] = (embedding, about, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, _, old) = self._entries.popitem(last=False)
            self.bytes -= old
