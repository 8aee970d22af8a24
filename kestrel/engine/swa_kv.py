"""Sliding-window layers in the paged engine: per-layer attention types and bounded SWA KV with replay.

Models: every layer is full attention or sliding-window attention (SWA, window W: the query at t sees keys
t-W+1..t), as ModelConfig.layer_window(i) says (Mistral: all layers; Qwen2 use_sliding_window: the layers from
max_window_layers on; HF layer_types). Each kind of layer is a KV *group* with its own attention backend, block
tables and masks (`KVGroups`); a model with one kind keeps the single-backend path unchanged.

Bounded SWA KV (`EngineConfig.swa_bounded_kv`): SWA keys older than the window are never read again, so the SWA
group does not live in the prefix-cached pool. It has a pool of its own (`SwaBlockManager`), per sequence:
before each step the blocks wholly older than the oldest key the step's queries read (num_computed - W + 1) go
back to the pool, so a sequence holds at most ceil((W - 1 + n) / block_size) + 1 SWA blocks for a step of n
new tokens (n = 1 when decoding) whatever its length. Dropped entries of its SWA block table point at block 0,
the null block (zeros, never written). Only the full-attention layers' blocks are prefix-cached.

Resuming from the prefix cache: a request whose first P tokens hit the cache has every full layer's K/V for
them but no SWA K/V. The engine restarts it at S < P and runs tokens S..P-1 again (the *replay*) before the new
ones: full layers attend over their cached K/V and write the replayed positions' fresh K/V to a trash block
(never over the shared cached blocks: for the first replayed positions they are wrong, see below); SWA layers
write their K/V into fresh SWA blocks. Keys before S read the null block. Stats: a request's cached tokens
(prefix_cache_hits, num_cached_tokens) count S, the tokens not run again; `swa_replayed_tokens` counts P - S.

How much to replay, exactly: a layer's output at t is exact when its inputs at t are and the keys it reads are.
Full layers read cached (exact) K/V, so they keep a position exact. SWA layer j (j-th SWA layer from the input)
reads keys t-W+1..t, so its output is exact only for t >= S + j * (W - 1): each SWA layer pushes the first exact
position W - 1 further, whether the SWA layers are adjacent or separated by full layers (a hybrid model). The
last SWA layer's keys at P-W+1..P-1 (what later queries read) and every layer's output at P and beyond are
exact iff P - S >= num_swa_layers * (W - 1) (`swa_replay.exact_replay_tokens`). A replay of just W tokens, as
DeepInfer does, is exact only for a single SWA layer; with more it drifts (tests/test_swa_replay.py shows
it). So the engine replays R = max(--swa-replay-tokens, num_swa_layers * (W - 1)) tokens by default, the start
S rounded down to a block boundary (replayed = P - S, in [R, R + block_size), or all of P when P < R) so no
SWA block is half-stale. --no-swa-replay-exact replays exactly --swa-replay-tokens and warns when that is below
the bound (faster resume, logits may differ slightly from a full prefill). We replay rather than keep a per-
prefix SWA tail snapshot: a snapshot at every cached block boundary costs W - 1 tokens of SWA KV per boundary,
i.e. about the full-length SWA KV we set out to drop.

Cost: an all-SWA model with many layers (Mistral 7B: 32 x 4095) has a bound beyond any prompt, so a prefix hit
saves memory but no compute there; models with a few SWA layers or a short window (gpt-oss: 12 x 127) resume
after ~R tokens. Not supported together (auto turns bounded KV off; asking for both is an error): speculative
decoding, tensor parallelism, decode CUDA graphs, and KV offload for a model without full-attention layers.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .attention import AttentionBackend, build_metadata
from .block_manager import BlockManager
from .swa_replay import exact_replay_tokens

log = logging.getLogger(__name__)
NULL_BLOCK = 0  # SWA pool block that dropped table entries point at (zeros, never allocated or written)


def has_mixed_windows(cfg) -> bool:
    return len({cfg.layer_window(i) for i in range(cfg.num_hidden_layers)}) > 1


@dataclass
class SwaPlan:
    window: int
    swa_layers: list[int]
    full_layers: list[int]
    replay_tokens: int  # R: the replay starts at the block boundary at or before P - R
    exact: bool  # R >= num_swa_layers * (window - 1)


def plan_swa(config, mc, engine_is_plain: bool) -> SwaPlan | None:
    """Resolve EngineConfig.swa_bounded_kv (None = auto: on for a model with SWA layers unless a feature it does
    not support is on) and the replay length. None = every layer keeps full-length KV."""
    swa = mc.swa_layers
    if not swa or config.swa_bounded_kv is False:
        return None
    full = [i for i in range(mc.num_hidden_layers) if i not in swa]
    unsupported = []
    if config.speculative is not None:
        unsupported.append("speculative decoding")
    if not engine_is_plain:
        unsupported.append("tensor parallelism")
    if config.cuda_graphs and torch.device(config.device).type == "cuda":
        unsupported.append("CUDA graphs (add --no-cuda-graphs)")
    if not full and config.kv_offload_gb > 0:
        unsupported.append("KV offload of a model without full-attention layers")
    if unsupported:
        if config.swa_bounded_kv:
            raise ValueError(f"--swa-bounded-kv does not support {', '.join(unsupported)} yet")
        return None
    W = mc.sliding_window
    bound = exact_replay_tokens(W, len(swa))
    R = config.swa_replay_tokens
    if config.swa_replay_exact and R < bound:
        log.info("SWA replay: %d tokens requested, replaying %d (= %d SWA layers x (window %d - 1)) so a "
                 "prefix-cache hit is exact", R, bound, len(swa), W)
        R = bound
    elif R < bound:
        log.warning("SWA replay of %d tokens is below the exactness bound %d (= %d SWA layers x (window %d - 1)): "
                    "after a prefix-cache hit, logits may differ slightly from a full prefill", R, bound,
                    len(swa), W)
    return SwaPlan(W, swa, full, R, R >= bound)


def size_pools(config, mc, plan: SwaPlan) -> tuple[int, int, int]:
    """-> (prefix-cached blocks, SWA pool blocks incl. the null block, max_model_len) within --kv-cache-gb."""
    bs, W = config.block_size, plan.window
    L = mc.max_position_embeddings
    per_layer_block = AttentionBackend.bytes_per_block(1, bs, mc.num_key_value_heads, mc.head_dim,
                                                       config.torch_dtype)
    # enough that the SWA pool never runs dry: every running sequence's window + the step's chunk
    swa_cap = config.max_num_seqs * (-(-(W - 1) // bs) + 2) + -(-config.max_num_batched_tokens // bs) + 1
    swa_min = -(-(W - 1) // bs) + 2 + -(-config.max_num_batched_tokens // bs) + 1  # one sequence
    n_full, n_swa = len(plan.full_layers), len(plan.swa_layers)
    budget = int(config.kv_cache_gb * (1 << 30))
    if config.num_kv_blocks is not None:
        full_blocks, swa_blocks = config.num_kv_blocks, swa_cap
    elif n_full == 0:
        swa_blocks, full_blocks = min(swa_cap, budget // (n_swa * per_layer_block)), 0
    else:
        # split in proportion to what one full-context sequence holds in each pool
        swa_tok, full_tok = n_swa * min(W + bs, L), n_full * L
        share = budget * swa_tok // (swa_tok + full_tok)
        swa_blocks = min(swa_cap, max(swa_min, share // (n_swa * per_layer_block)))
        full_blocks = (budget - swa_blocks * n_swa * per_layer_block) // (n_full * per_layer_block)
    if n_full == 0:  # blocks without KV: they only index the prefix cache (the hash chain)
        full_blocks = min(config.max_num_seqs * -(-L // bs), 1 << 16) if config.num_kv_blocks is None \
            else full_blocks
    if swa_blocks < swa_min or full_blocks < 1:
        raise ValueError(f"--kv-cache-gb {config.kv_cache_gb} leaves {swa_blocks} SWA / {full_blocks} full-attention "
                         f"KV blocks; one sequence needs {swa_min} SWA blocks")
    limit = min(L, full_blocks * bs)
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds what fits (model context {L}, KV cache "
                         f"{full_blocks * bs} tokens)")
    return full_blocks, swa_blocks, config.max_model_len or limit


class SwaBlockManager(BlockManager):
    """BlockManager whose blocks (prefix-cached) hold the full-attention layers, plus a per-sequence SWA pool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_swa_blocks: int,
                 plan: SwaPlan):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.window, self.replay_tokens = plan.window, plan.replay_tokens
        self.num_swa_blocks = num_swa_blocks
        self.swa_free = list(range(num_swa_blocks - 1, NULL_BLOCK, -1))  # pop() hands out low ids first

    def swa_blocks_held(self, seq) -> int:
        return sum(b != NULL_BLOCK for b in seq.swa_block_table)

    def match_prefix(self, seq) -> int:
        """Take the cached prefix P (full layers), then step back to the replay start S (see module docstring).
        Returns S, the tokens that are not run through the model."""
        P = super().match_prefix(seq)
        bs = self.block_size
        S = max(0, P - self.replay_tokens) // bs * bs
        seq.replay_end = P
        seq.num_computed_tokens = S
        return S

    def allocate(self, seq, num_new_tokens: int) -> bool:
        c, bs, table = seq.num_computed_tokens, self.block_size, seq.swa_block_table
        # drop SWA blocks wholly before the oldest key this step reads; the dropped ones form a prefix
        i = max(0, c - self.window + 1) // bs - 1
        while 0 <= i < len(table) and table[i] != NULL_BLOCK:
            self.swa_free.append(table[i])
            table[i] = NULL_BLOCK
            i -= 1
        end = -(-(c + num_new_tokens) // bs)
        first_new = c // bs  # blocks before it (only right after a replay start) were never computed
        need = sum(1 for j in range(len(table), end) if j >= first_new)
        if need > len(self.swa_free) or not super().allocate(seq, num_new_tokens):
            return False
        for j in range(len(table), end):
            table.append(self.swa_free.pop() if j >= first_new else NULL_BLOCK)
        return True

    def _drop_swa(self, seq, keep: int) -> None:
        while len(seq.swa_block_table) > keep:
            b = seq.swa_block_table.pop()
            if b != NULL_BLOCK:
                self.swa_free.append(b)

    def free_seq(self, seq) -> None:
        self._drop_swa(seq, 0)
        seq.replay_end = 0
        super().free_seq(seq)

    def free_tail(self, seq, keep_blocks: int) -> None:
        self._drop_swa(seq, keep_blocks)
        super().free_tail(seq, keep_blocks)

    def swa_stats(self) -> dict:
        return {"swa_kv_blocks": self.num_swa_blocks - 1, "swa_kv_blocks_used": self.num_swa_blocks - 1 - len(self.swa_free),
                "swa_replay_len": self.replay_tokens}


class _GroupedMeta:
    """One step's metadata per group; `.prefills` (rows of the step) is the first group's."""

    __slots__ = ("metas", "prefills")

    def __init__(self, metas):
        self.metas, self.prefills = metas, metas[0].prefills


class _GroupedCtx:
    __slots__ = ("route", "metas")

    def __init__(self, route, metas):
        self.route, self.metas = route, metas

    def attention(self, layer, q, k, v):
        backend, j, g = self.route[layer]
        return backend.forward(j, q, k, v, self.metas[g])


class KVGroups:
    """Group 0: full-attention layers (`full`, the prefix-cached block tables). Group 1: SWA layers (`swa`).
    Bounded (a SwaPlan): the SWA group has its own pool and tables (seq.swa_block_table) and group 0 a trash
    block for replayed tokens. Unbounded (a hybrid model with full-length KV): `full` holds every layer's cache
    in layer order (what CUDA graphs, KV offload and transfer index) and `swa` views the SWA layers' caches
    with the same block tables and the window mask."""

    def __init__(self, cfg, backend_cls, num_blocks: int, block_size: int, dtype, device, plan: SwaPlan | None = None,
                 num_swa_blocks: int = 0):
        self.block_size, self.device, self.plan = block_size, device, plan
        self.window = cfg.sliding_window
        swa = cfg.swa_layers
        full = [i for i in range(cfg.num_hidden_layers) if i not in swa]
        args = (block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        if plan is not None:
            self.trash = num_blocks  # one block past the allocator's: replayed full-layer K/V land there
            self.full = backend_cls(len(full), num_blocks + 1, *args, None)
            self.swa = backend_cls(len(swa), num_swa_blocks, *args, self.window)
            self.route = {i: (self.full, j, 0) for j, i in enumerate(full)}
        else:
            self.full = backend_cls(cfg.num_hidden_layers, num_blocks, *args, None)
            self.swa = backend_cls(0, num_blocks, *args, self.window)
            self.swa.k_cache = [self.full.k_cache[i] for i in swa]
            self.swa.v_cache = [self.full.v_cache[i] for i in swa]
            self.route = {i: (self.full, i, 0) for i in full}
        self.route.update({i: (self.swa, j, 1) for j, i in enumerate(swa)})
        self.layer_windows = [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)]
        self.num_replayed_tokens = 0

    def build(self, decode_seqs, prefill_seqs) -> tuple[_GroupedMeta, list[int]]:
        """decode_seqs: [seq]; prefill_seqs: [(seq, num_new)] -> (metadata, positions of the new tokens)."""
        bs, dev, bounded = self.block_size, self.device, self.plan is not None
        full, positions = build_metadata([(s.num_tokens, s.block_table) for s in decode_seqs],
                                         [(s.num_computed_tokens, n, s.block_table) for s, n in prefill_seqs],
                                         bs, None, dev)
        tab = (lambda s: s.swa_block_table) if bounded else (lambda s: s.block_table)
        swa, _ = build_metadata([(s.num_tokens, tab(s)) for s in decode_seqs],
                                [(s.num_computed_tokens, n, tab(s)) for s, n in prefill_seqs], bs, self.window, dev)
        if bounded:  # replayed tokens: their full-layer K/V go to the trash block, not the shared cached ones
            rows, slots = [], []
            for (s, n), p in zip(prefill_seqs, full.prefills):
                c, end = s.num_computed_tokens, min(s.num_computed_tokens + n, s.replay_end)
                rows.extend(range(p.start, p.start + max(0, end - c)))
                slots.extend(self.trash * bs + t % bs for t in range(c, end))
            if rows:
                self.num_replayed_tokens += len(rows)
                full.slot_mapping[torch.tensor(rows, device=full.slot_mapping.device)] = \
                    torch.tensor(slots, dtype=torch.long, device=full.slot_mapping.device)
        return _GroupedMeta([full, swa]), positions

    def context(self, meta: _GroupedMeta) -> _GroupedCtx:
        return _GroupedCtx(self.route, meta.metas)
