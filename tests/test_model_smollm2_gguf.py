"""The embedded SmolLM2-135M-Instruct GGUF (Q4_1): our loader (gguf dequantize + q/k un-permute) and decoder vs
transformers' own GGUF loader: logits on a chat prompt and a greedy continuation, token for token."""
import os

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from kestrel.engine.model_runner import prompt_logits  # noqa: E402
from kestrel.model.loader import embedded_gguf_path  # noqa: E402


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = embedded_gguf_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def eng():
    return LLMEngine(EngineConfig(progress=False, kv_cache_gb=0.05))


@pytest.fixture(scope="module")
def prompt_ids(eng):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return eng.tokenizer.encode(text)


def test_defaults_to_embedded_model(eng):
    assert eng.model_name == "SmolLM2-135M-Instruct"
    c = eng.model_config
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size, c.tie_word_embeddings) == (30, 576, 49152, True)
    assert "<|im_start|>" in eng.tokenizer.chat_template


def test_logits_match_transformers(hf_model, eng, prompt_ids):
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt_ids])).logits[0].float()
    got = prompt_logits(eng.model, prompt_ids)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_matches_transformers_generate(hf_model, eng, prompt_ids):
    n = 12  # the answer ("The capital of France is Paris.") ends with <|im_end|> before that
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    ref = out[0, len(prompt_ids):].tolist()
    got = eng.generate([prompt_ids], SamplingParams(max_tokens=n, temperature=0.0))[0]
    assert got.output_token_ids == ref
    assert got.finish_reason == ("stop" if ref[-1] in eng.model_config.eos_token_ids else "length")
    assert got.text == eng.tokenizer.decode(ref, skip_special_tokens=True)
