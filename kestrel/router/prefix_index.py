"""Approximate prefix index kept by the router: which replica most likely holds a prompt's prefix in its KV cache.

The router has no view into the replicas' block managers, so it mirrors the idea of them: the prompt text is cut
into fixed-size character chunks and each chunk's hash is chained with the previous one (like the engine's block
hashes, so a chunk hash names the whole prefix up to it). Every routed request inserts its chain for the chosen
replica; a new request's score for a replica is the length of its longest chained prefix seen there. The table is
LRU-bounded, so it forgets prefixes roughly the way the replicas' caches evict them. Character chunks instead of
tokens keep the router model-agnostic (about 4 characters per token, so 64 characters ~ one 16-token KV block).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict


def chunk_hashes(text: str, chunk_chars: int) -> list[bytes]:
    """Hash chain over full chunks only: a partial trailing chunk cannot be a cached block on the replica either."""
    hashes, prev = [], b""
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        prev = hashlib.blake2b(prev + text[start:start + chunk_chars].encode(), digest_size=12).digest()
        hashes.append(prev)
    return hashes


class PrefixIndex:
    def __init__(self, chunk_chars: int = 64, max_entries: int = 200_000):
        if chunk_chars < 1 or max_entries < 1:
            raise ValueError("chunk_chars and max_entries must be positive")
        self.chunk_chars = chunk_chars
        self.max_entries = max_entries
        # chained hash -> {replica_url: None}; both levels are kept in LRU order
        self._table: OrderedDict[bytes, OrderedDict[str, None]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def hashes(self, text: str) -> list[bytes]:
        return chunk_hashes(text, self.chunk_chars)

    def match(self, hashes: list[bytes], replicas: list[str]) -> dict[str, int]:
        """Number of leading chunks of the prompt each replica is believed to hold."""
        matched = {r: 0 for r in replicas}
        alive = set(replicas)
        for i, h in enumerate(hashes):
            holders = self._table.get(h)
            if not holders:
                break
            alive &= holders.keys()
            if not alive:
                break
            for r in alive:
                matched[r] = i + 1
        return matched

    def insert(self, hashes: list[bytes], replica: str) -> None:
        for h in hashes:
            holders = self._table.get(h)
            if holders is None:
                holders = self._table[h] = OrderedDict()
            else:
                self._table.move_to_end(h)
            if replica in holders:
                holders.move_to_end(replica)
            else:
                holders[replica] = None
                self._size += 1
        while self._size > self.max_entries:
            h, holders = next(iter(self._table.items()))
            holders.popitem(last=False)
            self._size -= 1
            if not holders:
                del self._table[h]

    def forget_replica(self, replica: str) -> None:
        """A replica that went down lost its cache (or will be restarted empty)."""
        for h in list(self._table):
            holders = self._table[h]
            if replica in holders:
                del holders[replica]
                self._size -= 1
                if not holders:
                    del self._table[h]
