"""The Gluon W4A8 kernels' register decodes (gemm_w4a8_tcg._ASM_E4M3: int4 codes, _ASM_PK: int4 codes of one word
with the activations' K permuted, _ASM_FP4_E4M3: e2m1 codes with the folded group exponent) run through the PTX emulator of test_gemm_w4a.py against the e4m3 codes torch gives for
the same values, and fold_multipliers against 2^(14 - down). The kernels themselves need a Hopper GPU
(tests/test_gemm_w4a8_tcg.py)."""
import pytest
import torch

from test_gemm_w4a import run_ptx

gl = pytest.importorskip("triton.experimental.gluon")
w4 = pytest.importorskip("kestrel.kernels.gemm_w4a8_tcg")


# OCP e2m1: code bit 3 the sign, bits 2..0 index these magnitudes (written out here, not taken from the package)
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e2m1(c: int) -> float:
    return -_E2M1[c & 7] if c & 8 else _E2M1[c & 7]


def _e4m3(v: float) -> int:
    return int(torch.tensor([v]).to(torch.float8_e4m3fn).view(torch.uint8))


def _words(g, n=4):
    return [int(v) & 0xFFFFFFFF for v in torch.randint(-2**31, 2**31 - 1, (n,), generator=g)]


@pytest.mark.parametrize("field", range(8))
def test_int4_e4m3_decode(field):
    """4 word rows of one field -> their codes c - 8 as e4m3, byte r of the result from word r."""
    g = torch.Generator().manual_seed(field)
    for _ in range(16):
        ws = _words(g)
        regs = {f"${i + 1}": ws[i] for i in range(4)}
        sel, sh = (field // 2) | ((field // 2 + 4) << 8), (field % 2) * 4
        regs.update({f"${i}": sel for i in range(5, 9)}, **{f"${i}": sh for i in range(9, 13)})
        out = run_ptx(w4._ASM_E4M3.value, regs)["$0"]
        want = sum(_e4m3(((w >> (4 * field)) & 15) - 8) << (8 * r) for r, w in enumerate(ws))
        assert out == want, (hex(out), hex(want))


@pytest.mark.parametrize("h", [0, 1])
def test_int4_pk_decode(h):
    """PK: the 4 nibbles of parity h of one word (fields 2 i + h) -> e4m3 of (c - 8) 2^-9, byte i from field 2 i + h;
    every code 0..15 in every byte position."""
    g = torch.Generator().manual_seed(h)
    words = _words(g, 32) + [0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x01234567]
    for w in words:
        regs = {f"${i}": w for i in range(1, 5)}
        regs.update({f"${i}": 4 * h for i in range(5, 9)})
        out = run_ptx(w4._ASM_PK.value, regs)["$0"]
        want = sum(_e4m3((((w >> (4 * (2 * i + h))) & 15) - 8) * 2.0 ** -9) << (8 * i) for i in range(4))
        assert out == want, (hex(w), hex(out), hex(want))


def test_k_perm128_matches_pk_registers():
    """quant_fp8(perm=True)'s column order puts, at wgmma k = 32 c + 16 h + 4 t + i, the activation of weight column
    16 (2 i + h) + 4 c + t: the field 2 i + h of word row 4 c + t that _ASM_PK decodes into byte i (a bijection)."""
    from kestrel.kernels.act_quant import k_perm128
    idx = k_perm128(256)
    assert sorted(idx.tolist()) == list(range(256))
    for kw in range(256):
        c, h, t, i = kw % 128 // 32, kw % 32 // 16, kw % 16 // 4, kw % 4
        kp = int(idx[kw]) % 128
        assert (kp // 16, kp % 16) == (2 * i + h, 4 * c + t) and idx[kw] // 128 == kw // 128


@pytest.mark.parametrize("field", range(8))
@pytest.mark.parametrize("down", [0, 3, 8])
def test_fp4_fold_e4m3_decode(field, down):
    """e2m1 codes x 2^-down exactly as e4m3 (sign, subnormal 0.5, zero and -0 included); the multiplier from
    fold_multipliers, the same f16 in both halves of $13 / $14."""
    g = torch.Generator().manual_seed(10 * field + down)
    mult = int(w4.fold_multipliers(torch.tensor([[down]], dtype=torch.uint8))[0, 0]) & 0xFFFF
    for _ in range(16):
        ws = _words(g)
        regs = {f"${i + 1}": ws[i] for i in range(4)}
        sel, sh = (field // 2) | ((field // 2 + 4) << 8), (field % 2) * 4
        regs.update({f"${i}": sel for i in range(5, 9)}, **{f"${i}": sh for i in range(9, 13)})
        regs.update({"$13": mult | (mult << 16), "$14": mult | (mult << 16)})
        out = run_ptx(w4._ASM_FP4_E4M3.value, regs)["$0"]
        codes = [(w >> (4 * field)) & 15 for w in ws]
        want = sum(_e4m3(_e2m1(c) * 2.0 ** -down) << (8 * r) for r, c in enumerate(codes))
        assert out == want, (hex(out), hex(want), codes)


def test_fold_multipliers():
    down = torch.randint(0, 9, (5, 12), dtype=torch.uint8)
    m = w4.fold_multipliers(down)
    assert m.shape == (12, 5) and m.dtype == torch.int16
    assert torch.equal(m.view(torch.float16).float(), torch.pow(2.0, 14 - down.float()).t())
