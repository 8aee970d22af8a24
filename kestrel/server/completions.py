"""POST /v1/completions (legacy text completions), streaming and not."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kestrel.engine.async_engine import EngineError
from kestrel.server.errors import APIError
from kestrel.server.protocol import CompletionRequest
from kestrel.server.serving import (SSE_DONE, ServerState, check_common, check_model, check_prompt, first_output,
                                    new_id, now, outputs, sampling_params, sse, sse_error, token_str,
                                    until_disconnect, usage)


def _logprobs(tok, entries: list[dict] | None, offset: int) -> dict | None:
    if entries is None:
        return None
    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        s = token_str(tok, e["token_id"])
        lp["tokens"].append(s)
        lp["token_logprobs"].append(e["logprob"])
        lp["top_logprobs"].append({token_str(tok, k): v for k, v in (e.get("top") or {}).items()})
        lp["text_offset"].append(offset)
        offset += len(s)
    return lp


def _merge(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Response:
    model = check_model(state, req.model)
    check_common(req)
    if req.best_of not in (None, 1):
        raise APIError("best_of must be 1", param="best_of", code="unsupported_value")
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix", code="unsupported_value")
    if req.echo and req.logprobs is not None:
        raise APIError("echo together with logprobs (prompt logprobs) is not supported", param="echo")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError("batched prompts are not supported: send one prompt per request", param="prompt",
                           code="unsupported_value")
        prompt = prompt[0]
    tok = state.tokenizer
    ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
    check_prompt(state, ids)
    params = sampling_params(state, req, len(ids), req.max_tokens, 16, req.logprobs)
    echo = (prompt if isinstance(prompt, str) else tok.decode(ids)) if req.echo else ""
    rid, created = new_id("cmpl"), now()

    def body(choices: list, **extra) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
                **extra}

    gen = outputs(state, rid, ids, params)
    if req.stream:
        ok, first = await until_disconnect(request, first_output(gen))
        if not ok:  # gave up while queued: until_disconnect already aborted it
            return Response(status_code=499)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(first, gen, body, tok, echo, len(ids), include_usage),
                                 media_type="text/event-stream")

    async def collect():
        text, lps, last = echo, None, None
        async for out in gen:
            lps = _merge(lps, _logprobs(tok, out.logprobs, len(text)))
            text += out.new_text
            last = out
        return text, lps, last

    finished, result = await until_disconnect(request, collect())
    if not finished:
        return Response(status_code=499)
    text, lps, last = result
    choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": last.finish_reason}
    return JSONResponse(body([choice], usage=usage(len(ids), last)))


async def _stream(first, gen, body, tok, echo: str, prompt_len: int, include_usage: bool):
    extra = {"usage": None} if include_usage else {}
    offset, last = 0, None
    try:
        if echo:
            yield sse(body([{"index": 0, "text": echo, "logprobs": None, "finish_reason": None}], **extra))
            offset = len(echo)

        async def all_outputs():
            yield first
            async for o in gen:
                yield o

        async for out in all_outputs():
            last = out
            if not (out.new_text or out.logprobs or out.finished):
                continue
            lp = _logprobs(tok, out.logprobs, offset)
            offset += len(out.new_text)
            choice = {"index": 0, "text": out.new_text, "logprobs": lp,
                      "finish_reason": out.finish_reason if out.finished else None}
            yield sse(body([choice], **extra))
        if include_usage:
            yield sse(body([], usage=usage(prompt_len, last)))
    except (ValueError, EngineError) as e:
        yield sse_error(e)
    finally:
        await gen.aclose()
    yield SSE_DONE
