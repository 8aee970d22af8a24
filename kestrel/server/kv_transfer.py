"""Prefill/decode disaggregation, HTTP side: the transport between replicas is HTTP on the host network with the
KV blocks serialized as safetensors (one `k` and one `v` tensor plus the token ids they hold).

    POST /kv/prefill {"kind": "chat"|"completion", "request": <OpenAI body>, "target": "http://decode-replica"}
        computes the prompt's KV here (one greedy token), exports the cached prefix blocks and pushes them to
        target's /kv/import (or returns the safetensors bytes when no target is given).
    POST /kv/import  <safetensors bytes>
        stores the blocks in this replica's prefix cache, so the same prompt sent here next only computes its tail.

The router (kestrel/router, --prefill-replica/--decode-replica) calls /kv/prefill and then sends the original
request to the decode replica, which streams the answer.
"""
from __future__ import annotations

import json
import secrets
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from kestrel.engine.kv_transfer import export_prefix_blocks, import_prefix_blocks
from kestrel.engine.sampling_params import SamplingParams
from kestrel.server.chat import chat_prompt_ids
from kestrel.server.errors import APIError
from kestrel.server.protocol import ChatCompletionRequest, CompletionRequest
from kestrel.server.serving import ServerState, check_prompt, new_id


def prompt_ids(state: ServerState, kind: str, body: dict) -> list[int]:
    """The token ids the replica's own endpoint would compute for this request (so the hashes line up)."""
    try:
        if kind == "chat":
            return chat_prompt_ids(state, ChatCompletionRequest.model_validate(body))
        if kind == "completion":
            prompt = CompletionRequest.model_validate(body).prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            return state.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    except ValidationError as e:
        raise APIError(f"invalid request for the prefill leg: {e.errors()[0].get('msg')}") from None
    raise APIError(f"kind must be 'chat' or 'completion', got {kind!r}", param="kind")


def install_kv_transfer(app: FastAPI, state: ServerState) -> None:
    def check_key(request: Request) -> None:
        if state.api_key and not secrets.compare_digest(request.headers.get("authorization", "").encode(),
                                                        f"Bearer {state.api_key}".encode()):
            raise APIError("Incorrect or missing API key", 401, code="invalid_api_key")

    @app.post("/kv/prefill")
    async def kv_prefill(request: Request):
        check_key(request)
        try:
            obj = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"request body is not valid JSON: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("request"), dict):
            raise APIError("expected {'kind': ..., 'request': {...}, 'target': URL}")
        ids = prompt_ids(state, obj.get("kind", "chat"), obj["request"])
        check_prompt(state, ids)
        t0 = time.perf_counter()
        async for _ in state.engine.generate(new_id("prefill"), ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                                                    ignore_eos=True)):
            pass
        tensors = await state.engine.call(lambda eng: export_prefix_blocks(eng, ids))
        from safetensors.torch import save

        data = save(tensors)
        n = tensors["k"].shape[0] if tensors["k"].dim() == 5 else 0
        info = {"prompt_tokens": len(ids), "blocks": n, "bytes": len(data),
                "prefill_s": round(time.perf_counter() - t0, 4)}
        target = obj.get("target")
        if not target:
            return Response(data, media_type="application/octet-stream", headers={"x-kestrel-kv-blocks": str(n)})
        headers = {"content-type": "application/octet-stream"}
        if state.api_key:
            headers["authorization"] = f"Bearer {state.api_key}"
        try:
            async with httpx.AsyncClient(timeout=60.0) as client:
                resp = await client.post(str(target).rstrip("/") + "/kv/import", content=data, headers=headers)
        except httpx.HTTPError as e:
            raise APIError(f"pushing KV to {target} failed: {type(e).__name__}: {e}", 502, "upstream_error") from None
        if resp.status_code != 200:
            raise APIError(f"{target} refused the KV blocks: HTTP {resp.status_code} {resp.text[:300]}", 502,
                           "upstream_error")
        return {**info, "imported": resp.json()["blocks"], "transfer_s": round(time.perf_counter() - t0, 4)}

    @app.post("/kv/import")
    async def kv_import(request: Request):
        check_key(request)
        from safetensors.torch import load

        try:
            tensors = load(await request.body())
            assert {"k", "v", "token_ids"} <= tensors.keys()
        except Exception as e:
            raise APIError(f"body is not a safetensors KV payload with k, v, token_ids: {e}") from None
        n = await state.engine.call(lambda eng: import_prefix_blocks(eng, tensors))
        return {"blocks": n, "total_imported": getattr(state.engine.engine, "num_kv_blocks_imported", n)}
