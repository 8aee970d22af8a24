"""Training prompts written by the target itself: it samples the user's turn of its own chat template.

Why: the draft head generalises only from many distinct contexts (R2 of session 2: 5120 template prompts gave
held-out slot-1 acceptance 0.43), and templates repeat their own phrasing. Sampling the user turn at temperature 1
gives as many distinct requests as asked for, in the target's own idea of what users write, at generation speed.
"""
from __future__ import annotations

import torch

_MARK = "\x00KESTREL_USER_TURN\x00"


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to where the user's message starts (system prompt included)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=False)
    if _MARK not in text:
        raise ValueError("the chat template does not render the user's message verbatim")
    return tokenizer.encode(text[:text.index(_MARK)], add_special_tokens=False)


def self_written_prompts(model, tokenizer, n: int, eos_ids, seed: int = 0, max_tokens: int = 40,
                         sample_tokens: int = 8, temperature: float = 1.0, min_chars: int = 8,
                         batch_size: int = 512) -> list[str]:
    """n distinct user prompts written by the target: the first `sample_tokens` tokens sampled at `temperature`
    (variety), the rest greedy (coherent requests), up to its end-of-turn token or max_tokens. Samples more rounds
    while duplicates or too-short texts leave fewer than n."""
    from kestrel.spec.static_generate import generate

    prefix = user_turn_prefix(tokenizer)
    dev = model.embed_tokens.weight.device
    g = torch.Generator(device=dev).manual_seed(seed)
    out, seen = [], set()
    for _ in range(4):
        want = n - len(out)
        if want <= 0:
            break
        want += want // 8 + 1  # a few extra for the ones dropped
        outs, _ = generate(model, [prefix] * want, max_tokens, batch_size, [temperature] * want, eos_ids=eos_ids,
                           sample_steps=sample_tokens, generator=g, want_hidden=False)
        for o in outs:
            t = tokenizer.decode(o, skip_special_tokens=True).strip()
            if len(t) >= min_chars and t not in seen:
                seen.add(t)
                out.append(t)
    return out[:n]
