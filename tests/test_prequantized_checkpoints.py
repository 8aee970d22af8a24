"""Pre-quantized HF checkpoints (GPTQ, AWQ, FP8, compressed-tensors) load straight into QuantLinear layers.

The test quantizes a tiny random Llama's linears itself and writes them the way the tools do, with its own small
packers written from the format definitions (AutoGPTQ QuantLinear.pack, AutoAWQ WQLinear_GEMM.from_linear,
compressed-tensors pack_to_int32, AutoFP8), not with kestrel's converters. Reference: the same codes dequantized
by each format's formula in float64, written as a plain float checkpoint and run by transformers. The dequantized
weights are exactly representable in float32 (small integer x fp16/bf16 scale, e4m3 x fp32 scale), so kestrel's
float32 logits must match transformers' to float32 rounding of the model itself (atol 2e-4, rtol 1e-4, as for the
float checkpoints in test_model_hf_tiny.py), and greedy tokens must be identical."""
import functools
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams
from kestrel.engine.model_runner import prompt_logits
from kestrel.kernels.quant_linear import QuantLinear
from kestrel.model import load_model
from kestrel.model.loader import load_tokenizer, resolve
from kestrel.model.loader_quantized import ConcatLinear, concat_quantized
from kestrel.model.quant_config import checkpoint_quant
from kestrel.quant.weight import dequantize

VOCAB = 8192  # < the embedded tokenizer's 49152 (only ids below VOCAB are used): a small, fast embedding
BASE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.1,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"]
PROMPT = [1, 504, 3108, 314, 2725, 30, 253, 1789, 28, 2887, 314, 260, 1130, 282, 4306, 47, 990, 19, 31]


# ---- independent packers (numpy, uint32 words, loops as in the tools' own code) ----

def pack_along_rows(vals: np.ndarray, bits: int, order=None) -> np.ndarray:
    """AutoGPTQ qweight: [R, C] -> [R*bits/32, C], word row r holds rows r*epw .. r*epw+epw-1, j at bit j*bits."""
    epw = 32 // bits
    out = np.zeros((vals.shape[0] // epw, vals.shape[1]), dtype=np.uint32)
    for row in range(out.shape[0]):
        for j in range(epw):
            out[row] |= vals[row * epw + j].astype(np.uint32) << np.uint32(bits * j)
    return out


def pack_along_cols(vals: np.ndarray, bits: int, order=None) -> np.ndarray:
    """[R, C] -> [R, C*bits/32]; word col c, field j holds column c*epw + order[j] (AWQ: order 0,2,4,6,1,3,5,7)."""
    epw = 32 // bits
    order = order or list(range(epw))
    out = np.zeros((vals.shape[0], vals.shape[1] // epw), dtype=np.uint32)
    for col in range(out.shape[1]):
        for j in range(epw):
            out[:, col] |= vals[:, col * epw + order[j]].astype(np.uint32) << np.uint32(bits * j)
    return out


def i32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.view(np.int32).copy())


# ---- test-side quantizers: (checkpoint tensors, float64 dequantized weight [N, K]) per linear ----

def gptq(w, prefix, *, bits, gs, sym, g_idx):
    """AutoGPTQ min-max quantizer + QuantLinear.pack (v1: stored zero = zero - 1)."""
    n, k = w.shape
    maxq = 2 ** bits - 1
    scales, zeros = torch.zeros(k // gs, n, dtype=torch.float64), torch.zeros(k // gs, n, dtype=torch.float64)
    for g in range(k // gs):
        cols = w[:, g_idx == g]
        xmin, xmax = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = torch.where(xmin < 0, -xmax, xmin)
        s = ((xmax - xmin) / maxq).half().double()  # stored fp16; codes are computed with the stored scale
        scales[g], zeros[g] = s, torch.full_like(s, (maxq + 1) / 2) if sym else torch.round(-xmin / s)
    s_k, z_k = scales[g_idx].t(), zeros[g_idx].t()  # [N, K] per input channel via g_idx
    q = torch.clamp(torch.round(w / s_k) + z_k, 0, maxq)
    deq = (q - z_k) * s_k
    t = {prefix + ".qweight": i32(pack_along_rows(q.t().numpy().astype(np.int64), bits)),
         prefix + ".qzeros": i32(pack_along_cols(((zeros.numpy().astype(np.int64) - 1) & maxq), bits)),
         prefix + ".scales": scales.half(), prefix + ".g_idx": torch.from_numpy(g_idx.astype(np.int32))}
    return t, deq


def awq(w, prefix, *, gs):
    """AutoAWQ pseudo_quantize_tensor (zero point) + WQLinear_GEMM.from_linear packing."""
    n, k = w.shape
    wg = w.reshape(n, k // gs, gs)
    s = ((wg.amax(-1) - wg.amin(-1)).clamp(min=1e-5) / 15).half().double()  # [N, G]
    z = torch.clamp(-torch.round(wg.amin(-1) / s), 0, 15)
    q = torch.clamp(torch.round(wg / s[..., None]) + z[..., None], 0, 15)
    deq = ((q - z[..., None]) * s[..., None]).reshape(n, k)
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    t = {prefix + ".qweight": i32(pack_along_cols(q.reshape(n, k).t().numpy().astype(np.int64), 4, order)),
         prefix + ".qzeros": i32(pack_along_cols(z.t().numpy().astype(np.int64), 4, order)),
         prefix + ".scales": s.t().contiguous().half()}
    return t, deq


def fp8(w, prefix, *, per_channel, scale_dtype=torch.float32):
    amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax()
    s = (amax / 448.0).to(scale_dtype)
    q = (w / s.double()).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = q.double() * s.double()
    return {prefix + ".weight": q, prefix + ".weight_scale": s}, deq


def ct_int_asym(w, prefix, *, gs, g_idx):
    """compressed-tensors pack-quantized, asymmetric int4, group strategy with actorder 'group' (weight_g_idx)."""
    n, k = w.shape
    scales, zps = torch.zeros(n, k // gs, dtype=torch.float64), torch.zeros(n, k // gs, dtype=torch.float64)
    for g in range(k // gs):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        s = ((hi - lo) / 15).to(torch.bfloat16).double()
        scales[:, g], zps[:, g] = s, torch.clamp(-8 - torch.round(lo / s), -8, 7)
    s_k, z_k = scales[:, g_idx], zps[:, g_idx]
    q = torch.clamp(torch.round(w / s_k) + z_k, -8, 7)
    deq = (q - z_k) * s_k
    t = {prefix + ".weight_packed": i32(pack_along_cols((q + 8).numpy().astype(np.int64), 4)),
         prefix + ".weight_scale": scales.to(torch.bfloat16),
         prefix + ".weight_zero_point": i32(pack_along_rows((zps + 8).numpy().astype(np.int64), 4)),
         prefix + ".weight_g_idx": torch.from_numpy(g_idx.astype(np.int32)),
         prefix + ".weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    return t, deq


FP4_GRID = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)  # e2m1 magnitudes by code


def nvfp4(w, prefix, global_scale):
    """compressed-tensors nvfp4-pack-quantized: e2m1 pairs (even element in the low nibble), e4m3 scale per 16,
    fp32 global scale stored as a divisor: w = fp4 * scale / global_scale."""
    n, k = w.shape
    blocks = w.reshape(n, k // 16, 16)
    s = (blocks.abs().amax(-1) / 6 * global_scale).to(torch.float8_e4m3fn)
    eff = s.double() / global_scale
    x = blocks / eff[..., None]
    idx = (x.abs()[..., None] - FP4_GRID).abs().argmin(-1)
    neg = (x < 0) & (idx > 0)
    deq = (torch.where(neg, -1.0, 1.0) * FP4_GRID[idx] * eff[..., None]).reshape(n, k)
    codes = (idx | neg.long() << 3).reshape(n, k)
    t = {prefix + ".weight_packed": (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8),
         prefix + ".weight_scale": s,
         prefix + ".weight_global_scale": torch.tensor([global_scale], dtype=torch.float32)}
    return t, deq


def int8_channel(w, prefix):
    """compressed-tensors int-quantized (W8A8 int8 checkpoints): int8 weight, fp32 scale [N, 1], w = q * s."""
    s = (w.abs().amax(1, keepdim=True) / 127).float()
    q = torch.clamp(torch.round(w / s.double()), -128, 127)
    return {prefix + ".weight": q.to(torch.int8), prefix + ".weight_scale": s}, q * s.double()


def _group_idx(k, gs, rng, shuffle):
    g = np.arange(k) // gs
    return g[rng.permutation(k)] if shuffle else g  # act-order: group of channel perm[i] is i // gs


CT_CONFIG = {"quant_method": "compressed-tensors", "quantization_status": "compressed", "ignore": ["lm_head"],
             "kv_cache_scheme": None}
VARIANTS = {  # name: (tied embeddings, quantization_config)
    "gptq-actorder-sym-g32": (True, {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                                     "sym": True, "damp_percent": 0.01, "static_groups": False,
                                     "true_sequential": True, "checkpoint_format": "gptq"}),
    "gptq-asym-g64": (False, {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": False,
                              "checkpoint_format": "gptq"}),
    "qwen2-awq-g64": (False, {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm",
                        "modules_to_not_convert": None}),
    "fp8-per-tensor": (True, {"quant_method": "fp8", "activation_scheme": "dynamic"}),
    "ct-int4-asym-g32-actorder": (False, {**CT_CONFIG, "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32,
                    "actorder": "group", "dynamic": False, "observer": "minmax"}}}}),
    "ct-fp8-channel": (True, {**CT_CONFIG, "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                     "dynamic": True, "symmetric": True},
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}}}),
}


ACT_ORDER = ("gptq-actorder-sym-g32", "ct-int4-asym-g32-actorder")
FUSED_GROUP = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv",
               "mlp.gate_proj": "gate_up", "mlp.up_proj": "gate_up"}


def quantize_linear(variant, w, prefix, layer, proj, rng, shared):
    """One linear -> (tensors, dequantized float64). `shared` holds per-layer g_idx shared by q/k/v and gate/up."""
    k = w.shape[1]
    if variant in ACT_ORDER:
        # layer 0: q/k/v (and gate/up) share one g_idx like real GPTQ (same inputs -> same Hessian order) -> one
        # packed GEMM; layer 1: every projection its own g_idx -> kestrel falls back to separate GEMMs
        key = FUSED_GROUP.get(proj, proj) if layer == 0 else proj
        g = shared.setdefault((layer, key), _group_idx(k, 32, rng, True))
        if variant == "gptq-actorder-sym-g32":
            return gptq(w, prefix, bits=4, gs=32, sym=True, g_idx=g)
        return ct_int_asym(w, prefix, gs=32, g_idx=g)
    if variant == "gptq-asym-g64":
        return gptq(w, prefix, bits=4, gs=64, sym=False, g_idx=_group_idx(k, 64, rng, False))
    if variant == "qwen2-awq-g64":
        return awq(w, prefix, gs=64)
    if variant == "fp8-per-tensor":
        return fp8(w, prefix, per_channel=False)
    if variant == "ct-fp8-channel":
        return fp8(w, prefix, per_channel=True, scale_dtype=torch.bfloat16)
    raise KeyError(variant)


def make_checkpoints(root, variant, seed=0):
    """-> (quantized dir with the embedded tokenizer, float reference dir)."""
    tied, qc = VARIANTS[variant]
    arch = "Qwen2" if variant.startswith("qwen2") else "Llama"  # Qwen2: q/k/v biases next to packed weights
    cfg = getattr(transformers, arch + "Config")(**BASE, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    hf = getattr(transformers, arch + "ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    rng = np.random.default_rng(seed)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    qtensors, shared = {}, {}
    for layer in range(cfg.num_hidden_layers):
        for proj in PROJ:
            prefix = f"model.layers.{layer}.{proj}"
            t, deq = quantize_linear(variant, sd.pop(prefix + ".weight").double(), prefix, layer, proj, rng, shared)
            qtensors.update(t)
            with torch.no_grad():
                hf.get_submodule(prefix).weight.copy_(deq.float())  # exact: deq is float32-representable
    if tied:
        sd.pop("lm_head.weight", None)
    qdir, rdir = os.path.join(root, "quantized"), os.path.join(root, "reference")
    hf.save_pretrained(rdir, safe_serialization=True)  # the plain float checkpoint transformers runs
    os.makedirs(qdir)
    save_file({**{k: v.contiguous() for k, v in sd.items()}, **qtensors}, os.path.join(qdir, "model.safetensors"))
    conf = cfg.to_dict()
    conf["quantization_config"] = qc
    with open(os.path.join(qdir, "config.json"), "w") as f:
        json.dump(conf, f)
    _tokenizer().save_pretrained(qdir)  # transformers runs on token ids: the reference needs none
    return qdir, rdir


@functools.lru_cache(maxsize=1)
def _tokenizer():
    return load_tokenizer(*resolve(None)[:2])


@pytest.fixture(scope="module", params=list(VARIANTS))
def ckpt(request, tmp_path_factory):
    """(variant, quantized dir, transformers on the float reference, an LLMEngine on the quantized dir)."""
    qdir, rdir = make_checkpoints(str(tmp_path_factory.mktemp(request.param)), request.param)
    ref = transformers.AutoModelForCausalLM.from_pretrained(rdir, dtype=torch.float32).eval()
    # naming the checkpoint's own method in --quantization is accepted
    eng = LLMEngine(EngineConfig(model=qdir, block_size=4, num_kv_blocks=64, progress=False,
                                 quantization=VARIANTS[request.param][1]["quant_method"]))
    return request.param, qdir, ref, eng


def test_logits_match_transformers_on_dequantized_reference(ckpt):
    variant, _, ref, eng = ckpt
    m = eng.model
    for i in range(2):  # every linear of the decoder is quantized; the lm_head / tied embedding stays float
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            mod = m.layers[i].get_submodule(name)
            assert isinstance(mod, (QuantLinear, ConcatLinear)), (i, name, type(mod))
    assert not isinstance(m.lm_head, QuantLinear) and m.lm_head.weight.dtype == torch.float32
    if VARIANTS[variant][0]:
        assert m.lm_head.weight is m.embed_tokens.weight
    if variant in ACT_ORDER:
        fused = m.layers[0].self_attn.qkv_proj  # shared g_idx: one act-order GEMM over q|k|v
        assert isinstance(fused, QuantLinear) and fused.spec.act_order
        assert fused.scales.dtype == (torch.float16 if variant.startswith("gptq") else torch.bfloat16)  # as stored
        assert isinstance(m.layers[1].self_attn.qkv_proj, ConcatLinear)  # different g_idx per part
    else:
        assert all(isinstance(m.layers[i].self_attn.qkv_proj, QuantLinear) for i in range(2))
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0].float()
    got = prompt_logits(m, PROMPT, block_size=4)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_greedy_tokens_match_transformers(ckpt):
    _, _, ref, eng = ckpt
    n_new = 10
    with torch.no_grad():
        out = ref.generate(torch.tensor([PROMPT]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                           pad_token_id=2)
    got = eng.generate([PROMPT], SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True))[0]
    assert got.output_token_ids == out[0, len(PROMPT):].tolist()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="kernel path needs TRITON_INTERPRET=1 on CPU")
def test_fused_layer_runs_in_the_triton_kernel(ckpt):
    variant, _, _, eng = ckpt
    if variant not in ACT_ORDER:
        pytest.skip("the act-order variants cover the kernel path (fp16 and bf16 scales, with and without zeros)")
    qw = eng.model.layers[0].self_attn.qkv_proj.qweight_struct
    x = torch.randn(3, qw.shape[1], dtype=torch.bfloat16)
    want = x.double() @ dequantize(qw).double().t()
    got = QuantLinear(qw, use_kernel=True)(x).double()
    assert ((got - want).norm() / want.norm()).item() < 1e-2  # bf16 activations/output


def _write(path, qc, tied=True):
    os.makedirs(path, exist_ok=True)
    conf = transformers.LlamaConfig(**BASE, tie_word_embeddings=tied).to_dict()
    conf["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(conf, f)
    return str(path)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     r"quant_method='bitsandbytes' is not supported; supported: gptq .*awq"),
    ({"quant_method": "gptq", "bits": 5, "group_size": 128}, r"GPTQ bits=5 is not supported; supported: 2, 3, 4, 8"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     r"AWQ version='gemv'.*supported: version gemm"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, r"block-wise FP8.*not supported"),
])
def test_unsupported_formats_are_clear_errors(tmp_path, qc, match):
    with pytest.raises(ValueError, match=match):
        load_model(_write(tmp_path / "m", qc), progress=False)


def test_quantization_flag_must_match_a_prequantized_checkpoint(tmp_path):
    path = _write(tmp_path / "m", {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                                   "desc_act": False})
    for bad in ("int8", "fp8", "awq", "none"):
        with pytest.raises(ValueError, match=rf"--quantization {bad} does not match .*gptq 4-bit, group 128.*"
                                             r"pass gptq or int4-g128"):
            load_model(path, progress=False, quantization=bad)


@pytest.mark.parametrize("fmt", ["nvfp4-pack-quantized", "int-quantized"])
def test_compressed_tensors_nvfp4_and_int8_fused_layer(fmt):
    """Layer level (the decoder path is covered above): q|k|v packed as llm-compressor writes them, one shared NVFP4
    global scale, loaded as one fused GEMM; reference: the float64 dequantized weights."""
    nvfp = fmt.startswith("nvfp4")
    w = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True} if nvfp \
        else {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
    quant = checkpoint_quant({**CT_CONFIG, "format": fmt, "config_groups": {"group_0": {"targets": ["Linear"],
                                                                                         "weights": w}}})
    torch.manual_seed(0)
    ws = {p: torch.randn(n, 128, dtype=torch.float64) * 0.05 for p, n in (("q_proj", 128), ("k_proj", 64),
                                                                        ("v_proj", 64))}
    gscale = float(torch.tensor(448 * 6 / max(v.abs().max() for v in ws.values()).item(), dtype=torch.float32))
    tensors, deqs = {}, []
    for p, wt in ws.items():
        prefix = f"model.layers.0.self_attn.{p}"
        t, deq = nvfp4(wt, prefix, gscale) if nvfp else int8_channel(wt, prefix)
        tensors.update(t)
        deqs.append(deq)
    fused = concat_quantized([quant.convert(f"model.layers.0.self_attn.{p}", tensors.get) for p in ws])
    assert fused is not None and fused.shape == (256, 128)
    x = torch.randn(5, 128, dtype=torch.float64)
    got = QuantLinear(fused)(x.float()).double()
    want = x @ torch.cat(deqs).t()
    assert ((got - want).norm() / want.norm()).item() < 1e-6  # float32 matmul; 1/global_scale rounded to fp32
