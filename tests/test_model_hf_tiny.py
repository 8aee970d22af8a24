"""Our Llama-family decoder vs transformers on tiny random checkpoints written by the test (HF dir format):
logits at every position, and greedy continuations token for token. Covers Llama (untied, llama3 RoPE scaling,
attention bias), SmolLM-like tied embeddings with GQA, Qwen2 (q/k/v bias), Mistral (sliding window shorter than
the sequence, so the window mask matters)."""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from kestrel.engine.model_runner import prompt_logits  # noqa: E402
from kestrel.model import load_model  # noqa: E402
from kestrel.model.cpu_linear import prepack_linears  # noqa: E402
from kestrel.model.loader import load_tokenizer, resolve  # noqa: E402

VOCAB = 49152  # the embedded tokenizer's vocabulary, saved next to the tiny weights

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, pad_token_id=2)

VARIANTS = {
    "llama3-rope-untied-bias": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=False, attention_bias=True, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "llama-tied-linear-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "mistral-swa": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, head_dim=16)),
}


def make_tiny_checkpoint(path, variant: str, seed: int = 0):
    cfg_name, model_name, extra = VARIANTS[variant]
    cfg = getattr(transformers, cfg_name)(**{**BASE, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # random biases too (HF initializes them to zero)
        for n, p in model.named_parameters():
            if n.endswith(".bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    load_tokenizer(*resolve(None)[:2]).save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_tiny_checkpoint(path, request.param)
    return request.param, path, hf


PROMPT = [1, 504, 3108, 314, 2725, 30, 253, 1789, 28, 2887, 314, 260, 1130, 282, 4306, 47, 990, 19, 31]


@pytest.mark.parametrize("prepack", [False, True], ids=["nn.Linear", "prepacked"])
def test_logits_match_transformers(tiny, prepack):
    _, path, hf = tiny
    ours = load_model(path, progress=False).model
    if prepack:
        assert prepack_linears(ours) == 4 * 2 + 1  # 4 per layer + lm_head (tied or not)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    got = prompt_logits(ours, PROMPT, block_size=4)  # several blocks: exercises the paged path
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_greedy_matches_transformers_generate(tiny):
    _, path, hf = tiny
    n_new = 12
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                          pad_token_id=2)
    ref = out[0, len(PROMPT):].tolist()
    eng = LLMEngine(EngineConfig(model=path, block_size=4, num_kv_blocks=64, progress=False))
    got = eng.generate([PROMPT], SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True))[0]
    assert got.output_token_ids == ref
    assert got.finish_reason == "length"


def test_config_read_from_hf_dir(tiny):
    variant, path, hf = tiny
    c = load_model(path, progress=False).config
    assert c.num_key_value_heads == hf.config.num_key_value_heads
    assert c.tie_word_embeddings == hf.config.tie_word_embeddings
    if variant == "qwen2":
        assert c.qkv_bias and not c.o_bias
    if variant == "mistral-swa":
        assert c.sliding_window == 8


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_model(str(tmp_path / "nope"), progress=False)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="neither config.json nor"):
        load_model(str(tmp_path / "empty"), progress=False)
