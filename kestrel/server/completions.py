"""POST /v1/completions (legacy text completions), streaming and not."""
from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import Response

from kestrel.server.errors import APIError
from kestrel.server.protocol import CompletionRequest
from kestrel.server.serving import (Events, RawJSON, ServerState, SSETemplate, check_common, check_model,
                                    check_prompt, encode_number, new_id, now, outputs, respond, sampling_params, sse,
                                    usage)

_str = json.encoder.encode_basestring  # ensure_ascii=False, as everywhere in the server


def _logprobs(token_str, entries: list[dict] | None, offset: int) -> dict | None:
    """token_str: token id -> its text (ServerState.token_str, cached)."""
    if entries is None:
        return None
    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        s = token_str(e["token_id"])
        lp["tokens"].append(s)
        lp["token_logprobs"].append(e["logprob"])
        lp["top_logprobs"].append({token_str(k): v for k, v in (e.get("top") or {}).items()})
        lp["text_offset"].append(offset)
        offset += len(s)
    return lp


def _logprobs_json(token_str, entries: list[dict], offset: int) -> RawJSON:
    """encode(_logprobs(token_str, entries, offset)), written directly: the generic encoder's per-call setup
    and walk were ~5 us of every streamed token with logprobs=0 (what benchmarks send)."""
    toks, lps, tops, offs = [], [], [], []
    num = encode_number
    for e in entries:
        s = token_str(e["token_id"])
        toks.append(_str(s))
        lps.append(num(e["logprob"]))
        top = {token_str(k): v for k, v in (e.get("top") or {}).items()}  # same key collapsing as _logprobs
        tops.append("{" + ", ".join([f"{_str(k)}: {num(v)}" for k, v in top.items()]) + "}")
        offs.append(str(offset))
        offset += len(s)
    return RawJSON(f'{{"tokens": [{", ".join(toks)}], "token_logprobs": [{", ".join(lps)}], '
                   f'"top_logprobs": [{", ".join(tops)}], "text_offset": [{", ".join(offs)}]}}')


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

    token_str = state.token_str

    def events(include_usage: bool) -> Events:
        extra = {"usage": None} if include_usage else {}
        chunk = SSETemplate(lambda text, lp, reason: body([{"index": 0, "text": text, "logprobs": lp,
                                                             "finish_reason": reason}], **extra), 3)
        offset = len(echo)

        def event(out) -> str:
            nonlocal offset
            if not (out.new_text or out.logprobs or out.finished):
                return ""
            lp = None if out.logprobs is None else _logprobs_json(token_str, out.logprobs, offset)
            offset += len(out.new_text)
            return chunk.render(out.new_text, lp, out.finish_reason if out.finished else None)

        return Events(head=lambda: chunk.render(echo, None, None) if echo else "", event=event,
                      tail=lambda last: sse(body([], usage=usage(len(ids), last))) if include_usage else "")

    async def collect():
        text, lps, last = echo, None, None
        async for out in gen:
            lps = _merge(lps, _logprobs(token_str, out.logprobs, len(text)))
            text += out.new_text
            last = out
        choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": last.finish_reason}
        return body([choice], usage=usage(len(ids), last))

    return await respond(request, req, gen, events, collect)
