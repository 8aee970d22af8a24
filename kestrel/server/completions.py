"""POST /v1/completions (legacy text completions), streaming and not."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from kestrel.server.errors import APIError
from kestrel.server.protocol import CompletionRequest
from kestrel.server.serving import (ServerState, check_common, check_model, check_prompt, new_id, now, outputs,
                                    respond, sampling_params, token_str, usage)


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

    async def chunks(outs, include_usage: bool):
        extra = {"usage": None} if include_usage else {}
        offset, last = 0, None
        if echo:
            yield body([{"index": 0, "text": echo, "logprobs": None, "finish_reason": None}], **extra)
            offset = len(echo)
        async for out in outs:
            last = out
            if not (out.new_text or out.logprobs or out.finished):
                continue
            lp = _logprobs(tok, out.logprobs, offset)
            offset += len(out.new_text)
            yield body([{"index": 0, "text": out.new_text, "logprobs": lp,
                         "finish_reason": out.finish_reason if out.finished else None}], **extra)
        if include_usage:
            yield body([], usage=usage(len(ids), last))

    async def collect():
        text, lps, last = echo, None, None
        async for out in gen:
            lps = _merge(lps, _logprobs(tok, out.logprobs, len(text)))
            text += out.new_text
            last = out
        choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": last.finish_reason}
        return body([choice], usage=usage(len(ids), last))

    return await respond(request, req, gen, chunks, collect)
