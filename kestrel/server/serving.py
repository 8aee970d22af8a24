"""What both OpenAI endpoints share: request → (prompt ids, SamplingParams) with every check that must give a
400, the engine's output stream with metrics, SSE framing, and cancellation when the client goes away."""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from contextlib import aclosing, suppress
from dataclasses import dataclass, fields
from functools import cached_property
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kestrel.engine.async_engine import AsyncLLMEngine, EngineError
from kestrel.engine.outputs import RequestOutput
from kestrel.engine.sampling_params import SamplingParams
from kestrel.server.errors import APIError, error_body
from kestrel.server.metrics import Metrics, RequestTimer
from kestrel.server.protocol import _Sampling


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    metrics: Metrics
    served_model_name: str
    api_key: str | None = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @cached_property
    def token_str(self) -> TokenStrings:
        return TokenStrings(self.tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(state: ServerState, model: str | None) -> str:
    names = {state.served_model_name, state.engine.model_name}
    if model and model not in names:
        raise APIError(f"The model `{model}` does not exist; this server serves `{state.served_model_name}`.",
                       param="model", code="model_not_found")
    return state.served_model_name


def check_common(req: _Sampling) -> None:
    if req.n != 1:
        raise APIError(f"n must be 1 (got {req.n}); send separate requests for several completions.", param="n",
                       code="unsupported_value")
    if req.logit_bias:
        raise APIError("logit_bias is not supported", param="logit_bias", code="unsupported_value")
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed when stream is true", param="stream_options")


def check_prompt(state: ServerState, ids: list[int]) -> None:
    if not ids:
        raise APIError("the prompt is empty", param="prompt")
    vocab = len(state.tokenizer)
    if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
        raise APIError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
    if len(ids) >= state.max_model_len:
        raise APIError(f"This model's maximum context length is {state.max_model_len} tokens, but the prompt has "
                       f"{len(ids)} tokens (at least one token must be left for the output).",
                       param="prompt", code="context_length_exceeded")


def sampling_params(state: ServerState, req: _Sampling, prompt_len: int, max_tokens: int | None,
                    default_max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    room = state.max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif isinstance(max_tokens, int) and max_tokens > room:
        raise APIError(f"This model's maximum context length is {state.max_model_len} tokens. However, you requested "
                       f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                       f"completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                       code="context_length_exceeded")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if req.seed is not None and not (-(2**63) <= req.seed < 2**64):
        raise APIError("seed must fit in 64 bits", param="seed", code="invalid_value")
    vocab = len(state.tokenizer)
    if any(t < 0 or t >= vocab for t in req.stop_token_ids or []):
        raise APIError(f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids", code="invalid_value")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=stop,
            stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, logprobs=logprobs,
            priority=req.priority)
    except ValueError as e:
        word = str(e).split(" ", 1)[0]
        param = word if word in {f.name for f in fields(SamplingParams)} else None
        raise APIError(str(e), param=param, code="invalid_value") from None


async def outputs(state: ServerState, rid: str, prompt_ids: list[int],
                  params: SamplingParams) -> AsyncIterator[RequestOutput]:
    """The engine's outputs for one request, recorded in the metrics."""
    timer = RequestTimer(state.metrics, len(prompt_ids))
    reason = "abort"
    try:
        async with aclosing(state.engine.generate(rid, prompt_ids, params)) as gen:
            async for out in gen:
                timer.on_tokens(len(out.new_token_ids))
                if out.finished:
                    reason = out.finish_reason or "stop"
                yield out
    except (ValueError, EngineError):
        reason = "error"
        raise
    finally:
        timer.on_finish(reason)


async def first_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    """Wait for the first output before answering, so a rejected request still gets a proper status code."""
    try:
        return await gen.__anext__()
    except ValueError as e:
        raise APIError(str(e), param="prompt") from None
    except EngineError as e:
        raise APIError(str(e), 500, "internal_error") from None


async def until_disconnect(request: Request, coro):
    """Run coro, cancelling it if the client disconnects first (uvicorn does not cancel handlers itself).
    Returns (finished, result)."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with suppress(BaseException):
            await task
        return False, None
    return True, task.result()


@dataclass(slots=True)
class Events:
    """How one streaming request turns into SSE text: head() before the first output, event(out) per output
    ("" to send nothing), tail(last) before [DONE]."""
    head: Callable[[], str]
    event: Callable[[RequestOutput], str]
    tail: Callable[[RequestOutput], str]


async def respond(request: Request, req: _Sampling, gen: AsyncIterator[RequestOutput], events, collect) -> Response:
    """Answer one request either way. Streaming: wait for the first output (so a refused request still gets a
    proper status code), then the SSE text of `events(include_usage)` (an object with head(), event(out) and
    tail(last), each returning ready SSE text). Otherwise: JSON from `collect()`. A client that goes away while
    waiting gets its request aborted (499)."""
    if req.stream:
        ok, first = await until_disconnect(request, first_output(gen))
        if not ok:  # gave up while queued: until_disconnect already aborted it
            return Response(status_code=499)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_sse_stream(first, gen, events(include_usage)), media_type="text/event-stream")
    finished, result = await until_disconnect(request, collect())
    if not finished:
        return Response(status_code=499)
    return JSONResponse(result)


async def _sse_stream(first: RequestOutput, gen: AsyncIterator[RequestOutput], events):
    """SSE framing: an engine error ends the stream with an error event; [DONE] always closes it. The builder
    returns finished SSE text per output (one generator hop and one ASGI send per output, nothing nested)."""
    try:
        last = first
        text = events.head() + events.event(first)
        if text:
            yield text
        async for last in gen:
            text = events.event(last)
            if text:
                yield text
        yield events.tail(last) + SSE_DONE
        return
    except (ValueError, EngineError) as e:
        yield sse_error(e)
    finally:
        await gen.aclose()
    yield SSE_DONE


# One shared encoder: json.dumps(obj, ensure_ascii=False) builds a new JSONEncoder on every call. Same output.
encode = json.JSONEncoder(ensure_ascii=False).encode


def sse(obj) -> str:
    return f"data: {encode(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(e: Exception) -> str:
    kind = "invalid_request_error" if isinstance(e, ValueError) else "internal_error"
    return sse(error_body(str(e), kind))


_SLOT = "\ue000kestrel-slot-{}\ue000"  # a private-use marker: never in an id or model name in practice
_SLOT_RE = re.compile('"\ue000kestrel-slot-(\\d+)\ue000"')


class SSETemplate:
    """An SSE event whose JSON body is fixed but for a few values (a stream's chunks differ only in text,
    logprobs and finish_reason): the fixed parts are encoded once per request, each event encodes only its
    values. render(*values) == sse(build(*values)) byte for byte."""

    __slots__ = ("lits", "order")

    def __init__(self, build, n: int):
        pieces = _SLOT_RE.split(sse(build(*(_SLOT.format(i) for i in range(n)))))
        self.lits = pieces[0::2]
        self.order = [int(i) for i in pieces[1::2]]
        assert sorted(self.order) == list(range(n)), "each value must appear exactly once"

    def render(self, *values) -> str:
        lits = self.lits
        out = [lits[0]]
        for k, i in enumerate(self.order, 1):
            out.append(_encode_value(values[i]))
            out.append(lits[k])
        return "".join(out)


_encode_str = json.encoder.encode_basestring  # what `encode` does for a str (ensure_ascii=False); C when available


class RawJSON(str):
    """Already-encoded JSON for an SSETemplate value (inserted as is)."""


def _encode_value(v) -> str:
    # JSONEncoder.encode takes a fast path only for str: None and numbers would build a C encoder per call
    if v is None:
        return "null"
    cls = v.__class__
    if cls is str:
        return _encode_str(v)
    if cls is RawJSON:
        return v
    return encode(v)


def encode_number(v) -> str:
    """encode(v) for an int or float, without the encoder's per-call setup."""
    if v.__class__ is float and v - v == 0:  # finite (json writes nan/inf its own way)
        return float.__repr__(v)
    return encode(v)


def usage(prompt_len: int, out: RequestOutput | None) -> dict:
    n = len(out.output_token_ids) if out else 0
    u = {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}
    if out is not None:
        u["prompt_tokens_details"] = {"cached_tokens": out.num_cached_tokens}
    return u


class TokenStrings:
    """Token id -> its text alone (what logprobs report), cached: the tokenizer call costs ~10 us and a stream
    with logprobs asks for one or more per token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            s = self.cache[tid] = self.tokenizer.decode([int(tid)])
        return s


def now() -> int:
    return int(time.time())
