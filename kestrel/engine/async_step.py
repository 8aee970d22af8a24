"""Asynchronous scheduling: the CPU schedules and prepares step n+1 while step n runs; tokens commit one step late.

Why: in a synchronous loop the device idles while Python schedules, builds inputs, appends tokens, detokenizes and
checks stop conditions. Here one worker thread runs each step's forward + sample (torch releases the GIL inside
its kernels, and on CUDA the worker blocks in the device sync, not the main thread), while the main thread
schedules the next step and commits the previous one.

Bookkeeping at launch (main thread), so the scheduler sees the step as done: num_computed_tokens advances and
each sampling sequence gets a PLACEHOLDER token. The next step's input for such a sequence is patched inside the
worker from the previous step's sampled ids (the worker runs steps in order, so they exist by then). At most one
step is in flight, so a placeholder is always a sequence's last token when the next step is prepared.

Commit (one step late) fills the placeholder, registers full blocks for the prefix cache (their token ids are
known only now), then runs the usual stop checks. A sequence that finished at step n may already be in step n+1
with one speculative token: it is freed at commit of n, its extra placeholder is dropped and step n+1's token for
it is discarded. Sequences that will certainly stop on length are not scheduled again (Scheduler.skip_done)."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch

from .sequence import Sequence

PLACEHOLDER = -1


class _InFlight:
    __slots__ = ("batch", "future", "index", "order", "slots")

    def __init__(self, batch, order, slots, future):
        self.batch, self.order, self.slots, self.future = batch, order, slots, future
        self.index = {id(batch.seqs[i]): j for j, i in enumerate(order)}  # seq -> row of its sampled token


class AsyncStepper:
    def __init__(self, engine):
        self.engine = engine
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kestrel-step")
        self.inflight: _InFlight | None = None
        # CUDA: the worker queues kernels on its own stream, so the main thread's small host-to-device copies
        # (attention metadata of the next step) do not wait behind the step in flight on the default stream
        dev = torch.device(engine.config.device)
        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None

    def step(self):
        eng = self.engine
        batch = eng.scheduler.schedule()
        launched = self._launch(batch) if batch.seqs else None
        prev, self.inflight = self.inflight, launched
        if prev is None:
            return []
        try:
            return self._commit(prev)
        except BaseException:
            # the step after a failed one fails too (it reads its tokens): drop it so the engine can recover
            self.inflight = None
            if launched is not None:
                launched.future.exception()
            raise

    def drain(self):
        """Commit the step in flight (nothing is left running on the worker afterwards)."""
        prev, self.inflight = self.inflight, None
        return self._commit(prev) if prev is not None else []

    # ---- launch: CPU prep on this thread, forward + sample on the worker ----
    def _launch(self, batch) -> _InFlight:
        eng, prev = self.engine, self.inflight
        st = eng.runner.prepare(batch)
        # input rows whose token is still being sampled by the step in flight: (row, row of prev's tokens).
        # Only a decode input can be one, and decode rows come first in st.ids and st.order.
        fix = []
        for r, tok in enumerate(st.ids):
            if tok == PLACEHOLDER:
                seq = batch.seqs[st.order[r]] if r < len(st.order) else None
                if seq is None or prev is None or id(seq) not in prev.index:
                    raise RuntimeError("async scheduling: a placeholder token outside a decode input")
                fix.append((r, prev.index[id(seq)]))
        seqs = [batch.seqs[i] for i in st.order]
        params = [s.params for s in seqs]
        gens = [s.generator for s in seqs]
        outs, out_fix = [], []
        for j, s in enumerate(seqs):
            o = s.output_token_ids
            if o and o[-1] == PLACEHOLDER:
                out_fix.append((j, prev.index[id(s)]))
            outs.append(o)
        prev_future = prev.future if prev is not None else None
        runner, stream = eng.runner, self.stream
        ready = None
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # the inputs prepare() copied to the device

        def work():
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                if ready is not None:
                    stream.wait_event(ready)
                try:
                    return run()
                finally:
                    if stream is not None:  # the step's tensors (freed after this) are no longer in use
                        stream.synchronize()

        def run():
            if fix or out_fix:
                prev_tokens = prev_future.result()[0]  # already done: the worker runs steps in order
                for r, j in fix:
                    st.ids[r] = prev_tokens[j]
                for j, k in out_fix:
                    outs[j][-1] = prev_tokens[k]
            order, logits = runner.execute(st)
            if not order:
                return [], []
            return runner.sampler(logits, params, outs, gens)

        future: Future = self.pool.submit(work)
        # the scheduler must see this step as done: advance progress, reserve a slot for each sampled token
        slots = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_output_tokens == 0:
                eng.num_prompt_tokens += n
        for i in st.order:
            seq = batch.seqs[i]
            slots.append(seq.num_tokens)
            seq.token_ids.append(PLACEHOLDER)
        eng.num_steps += 1
        return _InFlight(batch, st.order, slots, future)

    # ---- commit: one step late ----
    def _commit(self, fl: _InFlight):
        eng = self.engine
        tokens, logprobs = fl.future.result()
        now = time.monotonic()
        live = [not fl.batch.seqs[i].is_finished for i in fl.order]  # finished/aborted: discard the token
        for j, i in enumerate(fl.order):
            if live[j]:
                fl.batch.seqs[i].token_ids[fl.slots[j]] = tokens[j]
        for seq in fl.batch.seqs:  # their token ids are all known now
            if not seq.is_finished:
                eng.block_manager.register_full_blocks(seq)
        outputs = []
        for j, i in enumerate(fl.order):
            if not live[j]:
                continue
            seq: Sequence = fl.batch.seqs[i]
            pos = fl.slots[j]
            outputs.append(eng._append_token(seq, tokens[j], logprobs[j], now, index=pos))
            if seq.is_finished:
                del seq.token_ids[pos + 1:]  # the speculative placeholder of the step in flight
        return outputs


def wants_async(config, engine_is_plain: bool) -> bool:
    """Resolve EngineConfig.async_scheduling (None = auto: on unless a feature it does not support is on) and
    reject an explicit request for it together with one of those."""
    unsupported = []
    if config.speculative is not None:
        unsupported.append("speculative decoding")
    if config.kv_offload_gb > 0:
        unsupported.append("KV offload")
    if not engine_is_plain:
        unsupported.append("tensor parallelism")
    if config.async_scheduling is None:
        return not unsupported
    if config.async_scheduling and unsupported:
        raise ValueError(f"--async-scheduling does not support {', '.join(unsupported)} yet; "
                         f"run with --no-async-scheduling")
    return bool(config.async_scheduling)
