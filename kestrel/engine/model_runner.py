"""Runs one scheduled step: flattens the batch (decodes first, then prefill chunks), writes KV and attends through
the attention backend, computes logits only for sequences that produce a token, and samples."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from .attention import AttentionBackend, TorchAttentionBackend, block_table_array, build_metadata, to_device
from .sampler import Sampler
from .scheduler import ScheduledBatch
from .swa_kv import KVGroups, has_mixed_windows


class ForwardContext:
    """What the model's attention layers see: `ctx.attention(layer, q, k, v)`."""

    __slots__ = ("backend", "meta")

    def __init__(self, backend: AttentionBackend, meta):
        self.backend, self.meta = backend, meta

    def attention(self, layer: int, q, k, v):
        return self.backend.forward(layer, q, k, v, self.meta)


class StepInputs:
    """One step's inputs, prepared on the CPU (ModelRunner.prepare) and consumed by ModelRunner.execute."""

    __slots__ = ("ids", "positions", "meta", "order", "rows", "graph_args", "prefill_args")

    def __init__(self):
        self.ids: list[int] = []
        self.positions = self.meta = self.graph_args = self.prefill_args = None
        self.order: list[int] = []
        self.rows: list[int] = []


class ModelRunner:
    def __init__(self, model, model_config, num_blocks: int, block_size: int, dtype: torch.dtype, device: str,
                 seed: int = 0, backend_cls: type[AttentionBackend] | None = None, prepack: bool = True,
                 swa_plan=None, num_swa_blocks: int = 0):
        self.model = model
        self.cfg = model_config
        self.block_size = block_size
        self.device = device
        c = model_config
        if backend_cls is None:
            backend_cls = TorchAttentionBackend
            if torch.device(device).type == "cuda":
                from .attention_triton import TritonAttentionBackend
                backend_cls = TritonAttentionBackend
        self.kv_groups = None  # full + sliding-window layers (or bounded SWA KV): one backend per kind, swa_kv.py
        if swa_plan is not None or has_mixed_windows(c):
            self.kv_groups = KVGroups(c, backend_cls, num_blocks, block_size, dtype, device, swa_plan, num_swa_blocks)
            self.backend = self.kv_groups.full
        else:
            self.backend = backend_cls(c.num_hidden_layers, num_blocks, block_size, c.num_attention_heads,
                                       c.num_key_value_heads, c.head_dim, dtype, device, c.sliding_window)
        self.sampler = Sampler(seed)
        if torch.device(device).type == "cpu" and prepack:
            from kestrel.model.cpu_linear import prepack_linears

            prepack_linears(model)
        self.graphs = None  # DecodeCudaGraphs once enable_cuda_graphs() ran
        self.prefill_graphs = None  # PrefillCudaGraphs (prefill_graphs.py) once enable_prefill_graphs() ran
        self.use_prefill_graphs = True  # benches turn it off to compare with the eager prefill in one process
        self.prefill_graph_report = None  # enable_prefill_graphs: self-check per bucket, capture errors, kept buckets

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, progress: bool = True) -> None:
        """Capture decode steps of up to max_num_seqs sequences in CUDA graphs (GPU only; see cuda_graphs.py)."""
        from .cuda_graphs import DecodeCudaGraphs

        if self.kv_groups is not None and self.kv_groups.plan is not None:
            raise ValueError("CUDA graphs do not support bounded SWA KV")
        self.graphs = DecodeCudaGraphs(self.model, self.backend.k_cache, self.backend.v_cache, max_num_seqs,
                                       -(-max_model_len // self.block_size), self.cfg.sliding_window)
        if self.kv_groups is not None:  # a hybrid model: each layer's own window
            self.graphs.windows = [int(w or 0) for w in self.kv_groups.layer_windows]
        self.graphs.capture(progress)
        from .prefill_graphs import wanted
        if wanted() and self.kv_groups is None:  # (hybrid KV layouts: the eager prefill)
            self.enable_prefill_graphs(max_model_len)

    def enable_prefill_graphs(self, max_model_len: int, buckets=None, capture: bool = True, check: bool = True,
                              eager=None) -> None:
        """Replay single-sequence prefill chunks of up to max(buckets) tokens from CUDA graphs (prefill_graphs.py):
        the eager prefill of a short prompt is host-bound. capture=False (or a CPU model): the same padded step,
        run eagerly (tests). check: replay each bucket once against the eager prefill and drop those that fail or
        differ (prefill_graph_check.py; call before any sequence holds KV blocks: the check borrows the first
        blocks and restores them). eager: the reference, default _eager_prefill (tests pass a faulty one)."""
        from .prefill_graphs import DEFAULT_BUCKETS, PrefillCudaGraphs

        if self.kv_groups is not None:
            raise ValueError("prefill graphs: models with one KV layout only (no hybrid / bounded SWA KV)")
        pg = PrefillCudaGraphs(self.model, self.backend.k_cache, self.backend.v_cache,
                               -(-max_model_len // self.block_size), self.cfg.sliding_window,
                               buckets or DEFAULT_BUCKETS, capture)
        pg.capture()
        if check:
            from .prefill_graph_check import check_prefill_graphs
            check_prefill_graphs(pg, eager or self._eager_prefill, self.cfg.vocab_size)
        self.prefill_graph_report = {"check": pg.check, "capture_errors": pg.capture_errors, "kept": list(pg.buckets)}
        self.prefill_graphs = pg if pg.buckets else None  # nothing left: the eager prefill for every chunk

    @torch.inference_mode()
    def _eager_prefill(self, token_ids, start: int, block_table):
        """(logits [1, V], hidden [1, H]) of the last token of one sequence's prefill chunk, the eager way
        (the reference of the prefill graphs' self-check)."""
        meta, positions = build_metadata([], [(start, len(token_ids), block_table)], self.block_size,
                                         self.cfg.sliding_window, self.device)
        hidden = self.model(to_device(token_ids, torch.long, self.device), to_device(positions, torch.long,
                                                                                     self.device),
                            ForwardContext(self.backend, meta))[-1:]
        return self.model.compute_logits(hidden), hidden

    def prefill_graph_fits(self, seq, n: int) -> bool:
        """A lone prefill chunk of n tokens that a captured prefill graph holds."""
        pg = self.prefill_graphs
        return pg is not None and self.use_prefill_graphs and pg.fits(n, len(seq.block_table))

    @torch.inference_mode()
    def forward_step(self, batch: ScheduledBatch):
        """Returns (order, logits): `order` lists indices into batch.seqs of the sequences that sample this step
        (their prompt/recompute is complete), `logits` [len(order), vocab] float32."""
        return self.execute(self.prepare(batch))

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        """The CPU half of a step: flat token ids, positions, attention metadata (async scheduling runs this on
        the main thread and execute() on the worker)."""
        decode, prefill = [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            (decode if (n == 1 and seq.num_computed_tokens == len(seq.token_ids) - 1) else prefill).append(i)
        st = StepInputs()
        seqs = batch.seqs
        st.ids = [seqs[i].token_ids[-1] for i in decode]
        if self.graphs is not None and decode and not prefill and len(decode) <= self.graphs.batch_sizes[-1]:
            # snapshot as arrays now: the block tables may grow before the (async) launch reads them
            st.graph_args = (np.fromiter((len(seqs[i].token_ids) - 1 for i in decode), np.int64, len(decode)),
                             block_table_array([seqs[i].block_table for i in decode]))
            st.order = decode
            return st
        for i in prefill:
            s, n = batch.seqs[i], batch.num_new_tokens[i]
            st.ids.extend(s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n])
        if not decode and len(prefill) == 1 and self.prefill_graph_fits(seqs[prefill[0]], len(st.ids)):
            s = seqs[prefill[0]]
            # a snapshot of the table: it may grow before the (async) launch reads it
            st.prefill_args = (s.num_computed_tokens, list(s.block_table))
            st.order = prefill if s.num_computed_tokens + len(st.ids) == s.num_tokens else []
            return st
        if self.kv_groups is not None:
            st.meta, st.positions = self.kv_groups.build([batch.seqs[i] for i in decode],
                                                         [(batch.seqs[i], batch.num_new_tokens[i]) for i in prefill])
        else:
            st.meta, st.positions = build_metadata(
                [(batch.seqs[i].num_tokens, batch.seqs[i].block_table) for i in decode],
                [(batch.seqs[i].num_computed_tokens, batch.num_new_tokens[i], batch.seqs[i].block_table)
                 for i in prefill], self.block_size, self.cfg.sliding_window, self.device)
        # rows whose logits are needed: every decode, and prefills that reach the end of the known tokens
        st.order, st.rows = list(decode), list(range(len(decode)))
        for i, p in zip(prefill, st.meta.prefills):
            s = batch.seqs[i]
            if s.num_computed_tokens + batch.num_new_tokens[i] == s.num_tokens:
                st.order.append(i)
                st.rows.append(p.end - 1)
        return st

    @torch.inference_mode()
    def execute(self, st: StepInputs):
        """The device half: returns (order, logits) as forward_step does."""
        if st.graph_args is not None:
            logits = self.graphs.run_seqs(st.ids, *st.graph_args)
            return st.order, logits.float()
        if st.prefill_args is not None:
            logits, _ = self.prefill_graphs.run(st.ids, *st.prefill_args)
            return st.order, (logits.float() if st.order else None)
        # st.ids may already be a device tensor (async scheduling gathers tokens still being sampled there)
        input_ids = to_device(st.ids, torch.long, self.device)
        pos = to_device(st.positions, torch.long, self.device)
        ctx = self.kv_groups.context(st.meta) if self.kv_groups is not None else ForwardContext(self.backend, st.meta)
        hidden = self.model(input_ids, pos, ctx)
        if not st.order:
            return st.order, None
        rows = st.rows
        sel = hidden.index_select(0, to_device(rows, torch.long, hidden.device)) \
            if rows != list(range(len(rows))) or len(rows) != hidden.shape[0] else hidden
        logits = self.model.compute_logits(sel).float()
        return st.order, logits

    @torch.inference_mode()
    def sample(self, batch: ScheduledBatch, order: list[int], logits):
        seqs = [batch.seqs[i] for i in order]
        params = [s.params for s in seqs]
        return self.sampler(logits, params, output_ids_if_penalized(seqs, params), [s.generator for s in seqs])


def output_ids_if_penalized(seqs, params) -> list[list[int]] | None:
    """Each sequence's output ids, which only penalties read: copying them every step is O(context) per row."""
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        return [s.output_token_ids for s in seqs]
    return None


@torch.inference_mode()
def prompt_logits(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits at every position of one sequence, through the same paged-attention path the engine uses
    (a private KV cache sized for this prompt). For tests and scoring."""
    c = model.config
    n = len(token_ids)
    nb = -(-n // block_size)
    p = next(model.parameters())
    ids = torch.tensor(token_ids, dtype=torch.long, device=p.device)
    if has_mixed_windows(c):
        groups = KVGroups(c, TorchAttentionBackend, nb, block_size, p.dtype, p.device)
        seq = SimpleNamespace(num_tokens=n, num_computed_tokens=0, block_table=list(range(nb)))
        meta, positions = groups.build([], [(seq, n)])
        ctx = groups.context(meta)
    else:
        backend = TorchAttentionBackend(c.num_hidden_layers, nb, block_size, c.num_attention_heads,
                                        c.num_key_value_heads, c.head_dim, p.dtype, p.device, c.sliding_window)
        meta, positions = build_metadata([], [(0, n, list(range(nb)))], block_size, c.sliding_window, p.device)
        ctx = ForwardContext(backend, meta)
    hidden = model(ids, torch.tensor(positions, device=p.device), ctx)
    return model.compute_logits(hidden).float()
