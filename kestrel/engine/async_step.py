"""Asynchronous scheduling: the CPU schedules and prepares step n+1 while step n runs; tokens commit one step late.

Why: in a synchronous loop the device idles while Python schedules, builds inputs, appends tokens, detokenizes and
checks stop conditions. Two ways to run a step off the main thread's critical path:

- "stream" (CUDA): the engine thread queues step n+1 on the device stream right behind step n, before step n is
  done. A decode input whose token step n is still sampling is gathered on the device from step n's sampled-id
  tensor, so launching needs nothing from the host; step n's ids go to pinned host memory (non_blocking) with a
  CUDA event, and only the commit of step n waits on that event, while the device already runs step n+1. Host
  copies into the device use pinned memory (attention.to_device): a plain `.to("cuda")` waits for the queued steps.
  Rows whose sampling needs the host (temperature > 0, penalties) are sampled at launch, which waits for that step
  (correct, just no overlap for such steps); greedy logprobs are computed on the device and copied like the ids.
- "thread" (CPU): there is no device queue, so one worker thread runs each step's forward + sample (torch
  releases the GIL inside its kernels) while the main thread schedules the next step and commits the previous one.
  The worker patches placeholder inputs from the previous step's host token ids (it runs steps in order).

Bookkeeping at launch (main thread), so the scheduler sees the step as done: num_computed_tokens advances and
each sampling sequence gets a PLACEHOLDER token. At most one step is in flight, so a placeholder is always a
sequence's last token when the next step is prepared.

Commit (one step late) fills the placeholder, registers full blocks for the prefix cache (their token ids are
known only now), then runs the usual stop checks. A sequence that finished at step n may already be in step n+1
with one speculative token: it is freed at commit of n, its extra placeholder is dropped and step n+1's token for
it is discarded. Sequences that will certainly stop on length are not scheduled again (Scheduler.skip_done)."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .attention import to_device
from .model_runner import output_ids_if_penalized
from .sampler import logprob_entries, logprob_tensors
from .sequence import Sequence

PLACEHOLDER = -1


class _Done:
    """A step result already on the host."""

    def __init__(self, tokens, logprobs):
        self.value = (tokens, logprobs)

    def result(self):
        return self.value

    def exception(self):
        return None


class _DeviceTokens:
    """Greedy ids (and the logprobs asked for) still on the device: copied to pinned host memory behind the step;
    result() waits only for those copies."""

    def __init__(self, tokens: torch.Tensor, logprob_parts=None):
        self.event = None
        self.lp = logprob_parts
        if tokens.is_cuda:
            pin = lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            self.host = pin(tokens)
            if self.lp is not None:
                want, chosen, tops = self.lp
                self.lp = (want, pin(chosen), [(sel, pin(v), pin(i)) for sel, v, i in tops])
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tokens

    def result(self):
        if self.event is not None:
            self.event.synchronize()
        ids = self.host.tolist()
        return ids, logprob_entries(self.lp, len(ids), ids)

    def exception(self):
        return None


class _InFlight:
    __slots__ = ("batch", "future", "index", "order", "slots", "tokens")

    def __init__(self, batch, order, slots, future, tokens=None):
        self.batch, self.order, self.slots, self.future = batch, order, slots, future
        self.tokens = tokens  # "stream": the step's sampled ids as a device tensor (next step's inputs gather it)
        self.index = {id(batch.seqs[i]): j for j, i in enumerate(order)}  # seq -> row of its sampled token


def _device_greedy(params) -> bool:
    """Rows the sampler would answer with a plain argmax of the logits (no host work; logprobs are device ops)."""
    return all(p.temperature == 0.0 and not (p.presence_penalty or p.frequency_penalty) for p in params)


class AsyncStepper:
    def __init__(self, engine, mode: str | None = None):
        self.engine = engine
        dev = torch.device(engine.config.device)
        self.mode = mode or ("stream" if dev.type == "cuda" else "thread")
        if self.mode not in ("stream", "thread"):
            raise ValueError(f"unknown async scheduling mode {self.mode!r}")
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kestrel-step") \
            if self.mode == "thread" else None
        self.inflight: _InFlight | None = None
        self.wait_s = 0.0  # time the engine thread spent waiting for a step's tokens (overlap diagnostics)

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

    # ---- launch: CPU prep on this thread, forward + sample queued (stream) or on the worker (thread) ----
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
        outs, out_fix = output_ids_if_penalized(seqs, params), []
        for j, o in enumerate(outs or ()):  # penalties read the previous token: patched once it is known
            if o and o[-1] == PLACEHOLDER:
                out_fix.append((j, prev.index[id(seqs[j])]))
        if self.mode == "stream":
            future, tokens = self._run_queued(st, fix, out_fix, prev, params, outs, gens)
        else:
            future, tokens = self._submit(st, fix, out_fix, prev, params, outs, gens), None
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
        return _InFlight(batch, st.order, slots, future, tokens)

    @torch.inference_mode()
    def _run_queued(self, st, fix, out_fix, prev, params, outs, gens):
        runner = self.engine.runner
        if out_fix and any(p.presence_penalty or p.frequency_penalty for p in params):  # read the previous token
            prev_tokens = self._wait(prev)[0]
            for j, k in out_fix:
                outs[j][-1] = prev_tokens[k]
        if fix:  # gather step n's ids into step n+1's inputs on the device (queued behind step n)
            dev = prev.tokens.device
            ids = to_device([0 if t == PLACEHOLDER else t for t in st.ids], torch.long, dev)
            rows = to_device([r for r, _ in fix], torch.long, dev)
            src = to_device([k for _, k in fix], torch.long, dev)
            st.ids = ids.index_copy_(0, rows, prev.tokens.index_select(0, src))
        order, logits = runner.execute(st)
        if not order:
            return _Done([], []), None
        if _device_greedy(params):
            tokens = logits.argmax(-1)  # as the Sampler's all-greedy path, and its logprobs' device half
            return _DeviceTokens(tokens, logprob_tensors(logits, tokens, params)), tokens
        ids, logprobs = runner.sampler(logits, params, outs, gens)  # waits for this step
        return _Done(ids, logprobs), to_device(ids, torch.long, logits.device)

    def _submit(self, st, fix, out_fix, prev, params, outs, gens) -> Future:
        prev_future = prev.future if prev is not None else None
        runner = self.engine.runner

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

        return self.pool.submit(run)

    def _wait(self, fl: _InFlight):
        t = time.perf_counter()
        res = fl.future.result()
        self.wait_s += time.perf_counter() - t
        return res

    # ---- commit: one step late ----
    def _commit(self, fl: _InFlight):
        eng = self.engine
        tokens, logprobs = self._wait(fl)
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
