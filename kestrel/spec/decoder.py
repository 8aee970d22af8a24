"""One speculative engine step: draft, verify every request's draft in a single target forward, roll back KV
of rejected tokens, emit 1..k+1 tokens per request.

Verification reuses the engine's chunked-prefill path: a decoding sequence with k draft tokens is simply a
(1 + k)-token chunk on top of its cached context, so one forward serves plain decodes, prefill chunks and
verifications together. Requests that cannot speculate this step (penalties, no draft, no room, no KV blocks)
decode normally in the same forward and go through the engine's own sampler.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from kestrel.engine.attention import build_metadata
from kestrel.engine.model_runner import ForwardContext
from kestrel.engine.sampler import top_k_top_p_min_p_mask
from kestrel.spec.config import SpeculativeConfig
from kestrel.spec.drafter import Drafter, DraftInput
from kestrel.spec.scheduler import make_scheduler
from kestrel.spec.verify import verify_greedy, verify_sampling
from kestrel.spec.verify_graph import pad_rows


def _can_speculate(seq) -> bool:
    p = seq.params
    return not (p.presence_penalty or p.frequency_penalty)  # penalties would change p at every draft position


def _target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """Sampling rows [n, V] -> the exact distribution the engine's sampler draws from (temperature, top-k/p, min-p)."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    x = logits / temps[:, None]
    tk = torch.tensor([max(p.top_k, 0) for p in params], device=logits.device)
    tp = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    mp = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
    if bool((tk > 0).any() or (tp < 1).any() or (mp > 0).any()):
        x = top_k_top_p_min_p_mask(x, tk, tp, mp)
    return x.softmax(-1)


class SpecDecoder:
    def __init__(self, cfg: SpeculativeConfig, drafter: Drafter, device: str = "cpu"):
        self.cfg = cfg
        self.drafter = drafter
        self.scheduler = make_scheduler(cfg, device)
        self.hidden: dict[str, torch.Tensor] = {}  # request id -> target hidden state that produced its last token
        self.num_verifies = 0  # (request, step) pairs that verified >= 1 draft token
        self.num_draft_tokens = 0  # draft tokens verified
        self.num_accepted_tokens = 0
        self.num_spec_steps = 0
        self.loop_k_steps: dict[int, int] = {}  # overlapped loop: steps run per verify width K
        self.graphs = None  # VerifyGraphs (verify_graph.py): all-decode steps replay a captured verify forward
        self.loop = None  # SpecLoop (spec_loop.py): overlapped device loop for all-greedy decode batches

    @property
    def loop_active(self) -> bool:
        return self.loop is not None and self.loop.active_loop and self.loop.owner is self

    def loop_step(self, engine):
        return self.loop.step(engine, self)

    def drain_loop(self, engine):
        return self.loop.drain(engine, self) if self.loop_active else []

    def stats(self) -> dict:
        v = max(self.num_verifies, 1)
        return {
            "spec_drafter": self.cfg.drafter,
            "spec_schedule": self.cfg.schedule,
            "spec_num_verifies": self.num_verifies,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            # fraction of verified draft tokens that were accepted
            "spec_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
            # tokens emitted per verification (accepted drafts + the one the target always adds)
            "spec_mean_accepted_length": (self.num_accepted_tokens + self.num_verifies) / v if self.num_verifies else 0.0,
            **({"spec_loop_steps": dict(sorted(self.loop_k_steps.items())),
                "spec_loop_shrinks": self.loop.num_shrinks} if self.loop is not None else {}),
            **({"spec_loop_device_ms": {f"{b}x{k}": round(v, 3) for (b, k), v in sorted(self.loop.gpu_ms.items())},
                "spec_loop_host_ms": round(self.loop.host_ms, 3)} if self.loop is not None and self.loop.owner is self
               else {}),
        }

    # ---- drafting ----
    def _draft(self, engine, batch, decode_idx):
        """-> {batch index: (draft tokens list, draft probs [k, V] or None)} for the requests that speculate."""
        seqs = batch.seqs
        kmax = self.scheduler.max_k(len(seqs))
        cand = [i for i in decode_idx if _can_speculate(seqs[i])]
        if kmax == 0 or not cand:
            return {}
        if self.drafter.needs_hidden:
            cand = [i for i in cand if seqs[i].request_id in self.hidden]
        inputs = [DraftInput(seqs[i].request_id, seqs[i].token_ids, seqs[i].params.temperature,
                             self.hidden.get(seqs[i].request_id)) for i in cand]
        draft = self.drafter.propose(inputs, kmax) if inputs else None
        if draft is None or draft.tokens.shape[1] == 0:
            return {}
        # room left: never emit past max_tokens / max_model_len, never write KV past the context
        room = torch.tensor([max(0, min(seqs[i].params.max_tokens - seqs[i].num_output_tokens - 1,
                                        engine.max_model_len - seqs[i].num_tokens)) for i in cand])
        lens = torch.minimum(draft.lens.cpu(), room)
        k = self.scheduler.allocate(draft.confidence.cpu(), lens).tolist()
        toks = draft.tokens.tolist()
        out = {}
        for r, i in enumerate(cand):
            kb = k[r]
            if kb == 0:
                continue
            if not engine.block_manager.allocate(seqs[i], 1 + kb):  # no KV room for the drafts: plain decode
                continue
            out[i] = (toks[r][:kb], None if draft.probs is None else draft.probs[r, :kb])
        return out

    # ---- the step ----
    @torch.inference_mode()
    def step(self, engine, batch):
        runner, bm = engine.runner, engine.block_manager
        seqs, ns = batch.seqs, batch.num_new_tokens
        if self.loop is not None and self.loop.can_enter(engine, batch, self.hidden):
            self.loop.attach(self)
            self.loop.enter(engine, seqs, self.hidden)
            return self.loop.step(engine, self)[0]  # launches the first step: its tokens come with the next call
        decode_idx = [i for i, (s, n) in enumerate(zip(seqs, ns)) if n == 1 and s.num_computed_tokens == s.num_tokens - 1]
        drafts = self._draft(engine, batch, decode_idx)
        self.num_spec_steps += 1
        no_budget = self.scheduler.max_k(len(seqs)) == 0
        if not drafts and hasattr(engine, "run_batch") and (no_budget or not self.drafter.needs_hidden):
            # nothing to verify (e.g. high load: no spare budget): the engine's plain step, CUDA graphs and all.
            # It yields no hidden states, so a head drafter restarts from the next step that goes through here.
            outs = engine.run_batch(batch)
            for s in seqs:
                self.hidden.pop(s.request_id, None)
                if s.is_finished:
                    self.drafter.release(s.request_id)
            return outs

        g = self.graphs
        if g is not None and len(decode_idx) == len(seqs) and \
                g.shape_for(len(seqs), max([len(d[0]) for d in drafts.values()] + [1])) is not None:
            emitted, out_hidden = self._graph_forward(runner, seqs, drafts)
        else:
            emitted, out_hidden = self._eager_forward(runner, seqs, ns, decode_idx, drafts)

        # bookkeeping: KV now holds the scheduled tokens (+ accepted drafts); free blocks of rejected drafts
        engine.num_steps += 1
        bs = bm.block_size
        for i, (s, n) in enumerate(zip(seqs, ns)):
            if i in drafts:
                n = len(emitted[i][0])  # the last known token + accepted drafts are now cached
            s.num_computed_tokens += n
            if s.num_output_tokens == 0:
                engine.num_prompt_tokens += n
            if i in drafts:
                keep = -(-s.num_computed_tokens // bs)
                if len(s.block_table) > keep:  # blocks past keep hold only rejected drafts (no hashes either)
                    bm.free_tail(s, keep)
        outputs = []
        now = time.monotonic()
        for i, (toks, lps) in emitted.items():
            s = seqs[i]
            merged = None
            for t, lp in zip(toks, lps):
                o = engine._append_token(s, t, lp, now)
                merged = o if merged is None else _merge(merged, o)
                if o.finished:
                    break
            if not s.is_finished:
                bm.register_full_blocks(s)
                if i in out_hidden:
                    self.hidden[s.request_id] = out_hidden[i]
            else:
                self.hidden.pop(s.request_id, None)
                self.drafter.release(s.request_id)
            outputs.append(merged)
        if len(self.hidden) > 2 * len(engine.seqs) + 64:  # aborted requests never come back: forget them
            for rid in [r for r in self.hidden if r not in engine.seqs]:
                self.hidden.pop(rid)
                self.drafter.release(rid)
        return outputs

    def _eager_forward(self, runner, seqs, ns, decode_idx, drafts):
        """Mixed step (plain decodes, prefill chunks, verifications) in one eager forward: any batch."""
        fits = getattr(runner, "prefill_graph_fits", None)  # (tensor-parallel runners have no prefill graphs)
        if not decode_idx and len(seqs) == 1 and fits is not None and fits(seqs[0], ns[0]):
            return self._prefill_graph_forward(runner, seqs[0], ns[0])
        plain_dec = [i for i in decode_idx if i not in drafts]
        plain_set = set(plain_dec)
        chunks = [i for i in range(len(seqs)) if i not in drafts and i not in plain_set]
        spec = list(drafts)
        ids: list[int] = [seqs[i].token_ids[-1] for i in plain_dec]
        prefill_meta = []
        for i in chunks:
            s, n = seqs[i], ns[i]
            ids.extend(s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n])
            prefill_meta.append((s.num_computed_tokens, n, s.block_table))
        for i in spec:
            s = seqs[i]
            ids.append(s.token_ids[-1])
            ids.extend(drafts[i][0])
            prefill_meta.append((s.num_computed_tokens, 1 + len(drafts[i][0]), s.block_table))
        meta, positions = build_metadata([(seqs[i].num_tokens, seqs[i].block_table) for i in plain_dec], prefill_meta,
                                         runner.block_size, runner.cfg.sliding_window, runner.device)
        dev = runner.device
        hidden = runner.model(torch.tensor(ids, dtype=torch.long, device=dev),
                              torch.tensor(positions, dtype=torch.long, device=dev),
                              ForwardContext(runner.backend, meta))

        # rows that produce logits: plain decodes, completed prefills (last row), every row of a verification
        plain = list(plain_dec)
        rows = list(range(len(plain_dec)))
        for i, p in zip(chunks, meta.prefills[:len(chunks)]):
            if seqs[i].num_computed_tokens + ns[i] == seqs[i].num_tokens:
                plain.append(i)
                rows.append(p.end - 1)
        spec_rows = [(p.start, p.end) for p in meta.prefills[len(chunks):]]
        all_rows = rows + [r for a, b in spec_rows for r in range(a, b)]
        logits = runner.model.compute_logits(hidden[all_rows]).float() if all_rows else None

        emitted: dict[int, tuple[list[int], list]] = {}
        out_hidden: dict[int, torch.Tensor] = {}
        if plain:
            toks, lps = runner.sampler(logits[:len(plain)], [seqs[i].params for i in plain],
                                       [seqs[i].output_token_ids for i in plain], [seqs[i].generator for i in plain])
            for j, i in enumerate(plain):
                emitted[i] = ([toks[j]], [lps[j]])
                out_hidden[i] = hidden[rows[j]]
        if spec:
            self._verify(seqs, spec, drafts, spec_rows, logits[len(plain):], hidden, emitted, out_hidden)

        return emitted, out_hidden

    def _prefill_graph_forward(self, runner, s, n):
        """A lone prefill chunk through the engine's prefill graphs (the same prefill the no-spec step gets)."""
        start = s.num_computed_tokens
        logits, hid = runner.prefill_graphs.run(s.token_ids[start:start + n], start, s.block_table)
        if start + n < s.num_tokens:  # a chunk before the prompt's end: nothing to sample
            return {}, {}
        toks, lps = runner.sampler(logits.float(), [s.params], [s.output_token_ids], [s.generator])
        return {0: ([toks[0]], [lps[0]])}, {0: hid[0].clone()}  # copied out of the graph's static output

    def _graph_forward(self, runner, seqs, drafts):
        """All-decode step through a captured verify graph: every request is a (1 + k)-token chunk padded to K + 1
        (k = 0 for requests without a draft). Greedy rows without logprobs (drafted or not) are decided on the host
        from one copy of the argmax; rows that sample, want logprobs or have
        penalties take the general paths on the logits."""
        rows = [(s.token_ids[-1], drafts[i][0] if i in drafts else [], s.num_computed_tokens, s.block_table)
                for i, s in enumerate(seqs)]
        logits, top, hid = self.graphs.run(rows)
        S, V, H = logits.shape[1], logits.shape[2], hid.shape[2]
        top_l = top.tolist()  # the step's one device sync
        emitted: dict[int, tuple[list[int], list]] = {}
        hid_rows: dict[int, int] = {}
        fast, plain, rest = [], [], []
        for i, s in enumerate(seqs):
            p = s.params
            if p.temperature == 0.0 and p.logprobs is None and (i in drafts or _can_speculate(s)):
                fast.append(i)  # greedy: the target's argmax is the token (no penalties: those rows never draft)
            elif i in drafts:
                rest.append(i)
            else:
                plain.append(i)
        if plain:
            idx = torch.tensor([i * S for i in plain], device=logits.device)
            lg = logits.reshape(-1, V).index_select(0, idx).float()
            toks, lps = runner.sampler(lg, [seqs[i].params for i in plain], [seqs[i].output_token_ids for i in plain],
                                       [seqs[i].generator for i in plain])
            for j, i in enumerate(plain):
                emitted[i] = ([toks[j]], [lps[j]])
                hid_rows[i] = i * S
        if fast:  # a plain loop: numpy's fixed cost per op outweighs it at these widths (K <= 4, B <= ~64)
            spec, acc = [], []
            for i in fast:
                t = top_l[i]
                d = drafts[i][0] if i in drafts else ()
                a, n = 0, len(d)
                while a < n and d[a] == t[a]:
                    a += 1
                emitted[i] = ([*d[:a], t[a]], [None] * (a + 1))
                hid_rows[i] = i * S + a
                if n:
                    spec.append(i)
                    acc.append(a)
            if spec:
                self._record(seqs, spec, drafts, acc)
        if rest:  # sampled rows / logprobs: the general verification on the padded logits
            flat = [i * S + j for i in rest for j in range(len(drafts[i][0]) + 1)]
            lg = logits.reshape(-1, V).index_select(0, torch.tensor(flat, device=logits.device)).float()
            spec_rows = [(i * S, i * S + len(drafts[i][0]) + 1) for i in rest]
            self._verify(seqs, rest, drafts, spec_rows, lg, None, emitted, {}, hid_rows)
        if not self.drafter.needs_hidden:
            return emitted, {}
        order = list(hid_rows)
        # copy out of the graph's static output: the next replay overwrites it
        h = hid.reshape(-1, H).index_select(0, torch.tensor([hid_rows[i] for i in order], device=hid.device))
        return emitted, {i: h[j] for j, i in enumerate(order)}

    def _verify(self, seqs, spec, drafts, spec_rows, logits, hidden, emitted, out_hidden, hid_rows=None):
        """General verification (any mix of greedy / sampled rows, logprobs). `logits` holds each request's
        1 + k rows back to back; spec_rows[r] are request r's rows in `hidden`. One copy of the results to the host."""
        d_lists = [drafts[i][0] for i in spec]
        B, V = len(spec), logits.shape[-1]
        dev = logits.device
        K = max(map(len, d_lists))
        d_np, lens_np = pad_rows(d_lists, K)
        # padded target logits [B, K+1, V] in one gather: positions past a row's draft repeat its first row (they
        # are never read: acceptance masks them, the bonus/resample index is <= the draft length)
        off = np.cumsum(lens_np + 1) - (lens_np + 1)
        j = np.arange(K + 1)[None, :]
        src = off[:, None] + np.where(j <= lens_np[:, None], j, 0)
        tl = logits.index_select(0, torch.from_numpy(src.ravel()).to(dev)).view(B, K + 1, V)
        dt = torch.from_numpy(d_np).to(dev)
        lens = torch.from_numpy(lens_np).to(dev)
        out = torch.full((B, K + 1), -1, dtype=torch.long, device=dev)
        acc = torch.zeros(B, dtype=torch.long, device=dev)
        greedy = [r for r, i in enumerate(spec) if seqs[i].params.temperature == 0.0]
        if greedy:
            g = torch.tensor(greedy, device=dev)
            o, a = verify_greedy(dt[g], lens[g], tl[g].argmax(-1))
            out[g], acc[g] = o, a
        sampled = [r for r, i in enumerate(spec) if seqs[i].params.temperature > 0.0]
        # seeded requests verify with their own generator (their tokens must not depend on the batch)
        groups = [[r] for r in sampled if seqs[spec[r]].generator is not None]
        shared = [r for r in sampled if seqs[spec[r]].generator is None]
        if shared:
            groups.append(shared)
        for grp in groups:
            gen = seqs[spec[grp[0]]].generator if len(grp) == 1 and seqs[spec[grp[0]]].generator is not None else None
            g = torch.tensor(grp, device=dev)
            params = [seqs[spec[r]].params for r in grp]
            probs = _target_probs(tl[g].reshape(-1, V), [p for p in params for _ in range(K + 1)]).view(len(grp), K + 1, V)
            q = None
            if all(drafts[spec[r]][1] is not None for r in grp):
                q = torch.zeros(len(grp), K, V, device=dev)
                for j, r in enumerate(grp):
                    d = drafts[spec[r]][1]
                    q[j, :d.shape[0]] = d.to(dev)
            if gen is not None and gen.device != probs.device:
                o, a = verify_sampling(dt[g].cpu(), lens[g].cpu(), probs.cpu(), None if q is None else q.cpu(), gen)
            else:
                o, a = verify_sampling(dt[g], lens[g], probs, q, gen)
            out[g], acc[g] = o.to(dev), a.to(dev)
        res = torch.cat([acc[:, None], out], dim=1).tolist()  # one copy of the results
        acc_l = [r[0] for r in res]
        toks_l = [r[1:a + 2] for r, a in zip(res, acc_l)]
        lps_l = self._logprobs(seqs, spec, tl, toks_l)
        for r, i in enumerate(spec):
            toks = toks_l[r]
            lps = lps_l[r] if lps_l is not None else None
            emitted[i] = (toks, lps if lps is not None else [None] * len(toks))
            a = acc_l[r]
            if hid_rows is not None:  # graph path: the caller gathers hidden rows at once
                hid_rows[i] = spec_rows[r][0] + a
            else:
                out_hidden[i] = hidden[spec_rows[r][0] + a]
        self._record(seqs, spec, drafts, acc_l)

    @staticmethod
    def _logprobs(seqs, spec, tl, toks_l):
        """Logprob entries of the raw target distribution at each emitted position, batched over the rows that
        asked (one gather + one topk per distinct n, not a .item() per token: each is a device sync on a GPU)."""
        want = [r for r, i in enumerate(spec) if seqs[i].params.logprobs is not None]
        if not want:
            return None
        rr = [r for r in want for _ in toks_l[r]]
        jj = [j for r in want for j in range(len(toks_l[r]))]
        tt = [t for r in want for t in toks_l[r]]
        dev = tl.device
        sel = tl[torch.tensor(rr, device=dev), torch.tensor(jj, device=dev)].log_softmax(-1)  # [M, V]
        chosen = sel.gather(1, torch.tensor(tt, device=dev)[:, None])[:, 0].tolist()
        ns = [seqs[spec[r]].params.logprobs for r in rr]
        tops: list[dict] = [{} for _ in rr]
        for n in set(ns) - {0}:
            m = [x for x, nn in enumerate(ns) if nn == n]
            vals, idx = sel[torch.tensor(m, device=dev)].topk(n)
            for x, iv, vv in zip(m, idx.tolist(), vals.tolist()):
                tops[x] = dict(zip(iv, vv))
        out: list = [None] * len(spec)
        x = 0
        for r in want:
            out[r] = []
            for t in toks_l[r]:
                out[r].append({"token_id": t, "logprob": chosen[x], "top": tops[x]})
                x += 1
        return out

    def _record(self, seqs, spec, drafts, acc):
        nprop = [len(drafts[i][0]) for i in spec]
        self.num_verifies += len(spec)
        self.num_draft_tokens += sum(nprop)
        self.num_accepted_tokens += sum(acc)
        self.drafter.observe([seqs[i].request_id for i in spec], nprop, list(acc))


def _merge(a, b):
    """Fold the RequestOutput of a later token of the same step into the first one."""
    a.new_token_ids = a.new_token_ids + b.new_token_ids
    a.output_token_ids = b.output_token_ids
    a.new_text = a.new_text + b.new_text
    if b.logprobs is not None:
        a.logprobs = (a.logprobs or []) + b.logprobs
    a.finished, a.finish_reason, a.metrics = b.finished, b.finish_reason, b.metrics
    if hasattr(b, "text"):
        a.text = b.text
    return a
