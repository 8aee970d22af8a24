"""Paged KV-cache bookkeeping: fixed-size blocks, a free list, and automatic prefix caching.

A full, computed block is registered under a hash chained from its predecessor's hash and its own token ids,
so equal prefixes map to equal hash chains. Blocks are reference counted; a block whose count drops to zero
keeps its contents and hash and goes to the tail of an LRU free list, so it can still be hit until it is
reused for new tokens (eviction = taking the oldest free block)."""
from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence


class Block:
    __slots__ = ("id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # head = evict first
        self.hash_to_block: dict[int, int] = {}
        self.offload = None  # optional HostKVTier (kv_offload.py): evicted prefix blocks go there, hits come back

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        need = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        return need if need > 0 else 0

    # ---- prefix cache ----
    @staticmethod
    def _chain(prev: int | None, tokens: tuple[int, ...]) -> int:
        return hash((prev, tokens))

    def match_prefix(self, seq: Sequence) -> int:
        """For a sequence with nothing computed: take the longest cached run of its full blocks. At least one
        token is left to compute, since the last position's logits are needed. Returns cached tokens."""
        assert seq.num_computed_tokens == 0 and not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        bs, prev = self.block_size, None
        seq.block_hashes = []
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = self._chain(prev, tokens)
            bid = self.hash_to_block.get(h)
            if bid is None and self.offload is not None and h in self.offload and self.free:
                bid = self._restore(h, tokens)  # comes back referenced
                if bid is None:
                    break
            elif bid is None or self.blocks[bid].token_ids != tokens:
                break
            else:
                self._ref(bid)
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
            prev = h
        n = len(seq.block_table) * bs
        seq.num_computed_tokens = n
        return n

    def cached_prefix_blocks(self, token_ids: list[int]) -> list[int]:
        """Ids of the leading full blocks of `token_ids` resident in the prefix cache, without taking references
        (for KV export; the last token is left out as in match_prefix)."""
        bs, prev, ids = self.block_size, None, []
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = self._chain(prev, tokens)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tokens:
                break
            ids.append(bid)
            prev = h
        return ids

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish blocks that became full and computed in the last step so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = seq.block_hashes
        if seq.num_computed_tokens < (len(hashes) + 1) * bs:  # no newly full block (most decode steps)
            return
        n_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        if len(hashes) >= n_full:
            return
        prev = hashes[-1] if hashes else None
        for i in range(len(hashes), n_full):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = self._chain(prev, tokens)
            hashes.append(h)
            blk = self.blocks[seq.block_table[i]]
            if blk.hash is None and h not in self.hash_to_block:
                blk.hash, blk.token_ids = h, tokens
                self.hash_to_block[h] = blk.id
            prev = h

    # ---- allocation ----
    def _ref(self, bid: int) -> None:
        blk = self.blocks[bid]
        if blk.ref_count == 0:
            del self.free[bid]
        blk.ref_count += 1

    def _restore(self, h: int, tokens: tuple[int, ...]) -> int | None:
        """Bring an offloaded prefix block back into a free device block instead of recomputing it."""
        bid = self._take_free()
        if not self.offload.load(h, tokens, bid):
            self.blocks[bid].ref_count = 0
            self.free[bid] = None
            self.free.move_to_end(bid, last=False)
            return None
        blk = self.blocks[bid]
        blk.hash, blk.token_ids = h, tokens
        self.hash_to_block[h] = bid
        return bid

    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        blk = self.blocks[bid]
        if blk.hash is not None:  # evict its cache entry: contents are about to be overwritten
            if self.hash_to_block.get(blk.hash) == bid:
                del self.hash_to_block[blk.hash]
                if self.offload is not None:
                    self.offload.save(blk.hash, blk.token_ids, bid)
            blk.hash = blk.token_ids = None
        blk.ref_count = 1
        return bid

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of seq; all-or-nothing."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def free_seq(self, seq: Sequence) -> None:
        # reverse order: a chain's tail is evicted before its head, which more requests are likely to share
        for bid in reversed(seq.block_table):
            blk = self.blocks[bid]
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self.free[bid] = None
                if blk.hash is None:  # nothing worth keeping: reuse it first
                    self.free.move_to_end(bid, last=False)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def free_tail(self, seq: Sequence, keep_blocks: int) -> None:
        """Release the blocks after the first keep_blocks (e.g. KV of rejected speculative tokens)."""
        while len(seq.block_table) > keep_blocks:
            bid = seq.block_table.pop()
            blk = self.blocks[bid]
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self.free[bid] = None
                if blk.hash is None:
                    self.free.move_to_end(bid, last=False)
        del seq.block_hashes[keep_blocks:]

    def reset_prefix_cache(self) -> None:
        for blk in self.blocks:
            if blk.ref_count == 0:
                blk.hash = blk.token_ids = None
        self.hash_to_block = {h: b for h, b in self.hash_to_block.items() if self.blocks[b].hash == h}
