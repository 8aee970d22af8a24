"""POST /v1/chat/completions: messages → the tokenizer's chat template → the engine; streaming and not."""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from kestrel.server.errors import APIError
from kestrel.server.protocol import ChatCompletionRequest
from kestrel.server.serving import (Events, ServerState, SSETemplate, check_common, check_model, check_prompt,
                                    new_id, now, outputs, respond, sampling_params, sse, usage)


def _entry(token_str, tid: int, logprob: float) -> dict:
    s = token_str(tid)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def _logprobs(token_str, entries: list[dict] | None) -> dict | None:
    """token_str: token id -> its text (ServerState.token_str, cached)."""
    if entries is None:
        return None
    content = []
    for e in entries:
        top = sorted((e.get("top") or {}).items(), key=lambda kv: -kv[1])
        content.append({**_entry(token_str, e["token_id"], e["logprob"]),
                        "top_logprobs": [_entry(token_str, k, v) for k, v in top]})
    return {"content": content}


def chat_prompt_ids(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    # "developer" is OpenAI's new name for "system"; templates only know the latter.
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    tok = state.tokenizer
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # template-enforced rules, e.g. role order
        raise APIError(f"cannot apply the chat template to these messages: {e}", param="messages") from None
    # The template already writes any special tokens the model expects.
    return tok.encode(text, add_special_tokens=False)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request) -> Response:
    model = check_model(state, req.model)
    check_common(req)
    if req.tools:
        raise APIError("tools are not supported", param="tools", code="unsupported_value")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise APIError("only response_format {'type': 'text'} is supported", param="response_format",
                       code="unsupported_value")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
    ids = chat_prompt_ids(state, req)
    check_prompt(state, ids)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(state, req, len(ids), max_tokens, None, logprobs)
    rid, created = new_id("chatcmpl"), now()
    token_str = state.token_str

    def body(obj: str, choices: list, **extra) -> dict:
        return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}

    gen = outputs(state, rid, ids, params)

    def events(include_usage: bool) -> Events:
        extra = {"usage": None} if include_usage else {}
        chunk = "chat.completion.chunk"
        delta = SSETemplate(lambda text, lp: body(chunk, [{"index": 0, "delta": {"content": text}, "logprobs": lp,
                                                           "finish_reason": None}], **extra), 2)

        def event(out) -> str:
            text = ""
            if out.new_text or out.logprobs:
                lp = None if out.logprobs is None else _logprobs(token_str, out.logprobs)
                text = delta.render(out.new_text, lp)
            if out.finished:
                text += sse(body(chunk, [{"index": 0, "delta": {}, "logprobs": None,
                                          "finish_reason": out.finish_reason}], **extra))
            return text

        return Events(
            head=lambda: sse(body(chunk, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}], **extra)),
            event=event,
            tail=lambda last: sse(body(chunk, [], usage=usage(len(ids), last))) if include_usage else "")

    async def collect():
        text, content, last = "", None, None
        async for out in gen:
            text += out.new_text
            lp = _logprobs(token_str, out.logprobs)
            if lp is not None:
                content = (content or []) + lp["content"]
            last = out
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None if content is None else {"content": content}, "finish_reason": last.finish_reason}
        return body("chat.completion", [choice], usage=usage(len(ids), last))

    return await respond(request, req, gen, events, collect)
