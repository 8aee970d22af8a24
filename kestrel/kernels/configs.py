"""The three config layers of the WNA16 GEMM.

LayerConfig   what is computed: the weight format (QuantSpec) and the layer shape (N, K). Fixed per layer.
ComputeConfig how it is computed: kernel kind, tile sizes, split-K, warps, stages. Part of the JIT key.
TuningConfig  which ComputeConfig to use for (GPU, layer, M): tune cache (user file, then the packaged per-GPU
              cache) and, failing both, a heuristic. `kestrel tune` fills the user cache.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from kestrel.quant.spec import QuantSpec

# named for its first GPU; it holds every GPU's entries, keyed by the torch device name (H200; H100 since session 15)
PACKAGED_CACHE = Path(__file__).with_name("tune_cache_h200.json")
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def nonempty_split(split: int, steps: int) -> int:
    """At most `split` K splits of `steps` K steps with none empty (ceil-sized parts: the last must get a step)."""
    split = max(1, min(split, steps))
    while split > 1 and (split - 1) * -(-steps // split) >= steps:
        split -= 1
    return split


@dataclass(frozen=True)
class LayerConfig:
    spec: QuantSpec
    n: int
    k: int

    @property
    def key(self) -> str:
        return f"{self.spec.name}|n{self.n}|k{self.k}"


@dataclass(frozen=True)
class ComputeConfig:
    # "stream" / "gemv" (CUDA cores, tiny M) | "mv" / "mvs" (tensor cores, M <= 16) | "tc" (tensor cores, M > 16)
    # | "tcg" (Gluon, Hopper: decode overlapped with an async wgmma; int4 g128, gemm_wna16_tcg.py)
    # | "dot" (older tensor-core path) | "dequant_mm" (Triton dequant to bf16 + cuBLAS, large M)
    kernel: str = "dot"
    block_m: int = 16
    block_n: int = 64
    block_k: int = 0  # tc/mv: K step (0 = one planar block, packing.py); dequant_mm: unused (one block per program)
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False  # "tc": y^T = W^T x^T (decoded W as the wgmma A operand, x^T as B)
    prefetch: int = 0  # "mv"/"mvs": planar blocks kept in flight to the L2 ahead of the loads (bulk prefetch)
    # "dequant_mm": N column blocks; > 1 dequantizes block i+1 on a side stream while cuBLAS multiplies block i
    chunks: int = 1
    # "tc" with split_k > 1: 0 = fp32 atomics into a zeroed buffer, then a cast kernel; 1 = in-kernel reduction (the
    # last split of each tile sums the others' workspace partials and stores y: one launch)
    reduce: int = 0
    # "tc": register cap per thread (0 = the compiler's choice). 128 lets two 8-warp CTAs share an SM where the
    # compiler takes more (the split-K reduction's epilogue raises a 128x128 tile from 128 to 170 registers)
    maxnreg: int = 0
    # "tcg" with swap: 1 = warp-specialised (a loader warp refills the TMA ring on mbarriers; no CTA barrier per
    # step); 2 = also each of the two consumer warpgroups in its own partition (half the tile's weight rows each)
    ws: int = 0
    # "tcg" swap with reduce: 1 = split over K only the tiles of the grid's last partial wave (at most split_k, so
    # they fill one wave of the SMs), the whole waves' tiles unsplit (one launch; they pass the in-kernel reduction
    # with a single partial). A grid of 1.2 waves should run ~1.25 waves long instead of 2 without split-K's
    # zeroed fp32 y, atomics and cast on every tile. Not yet timed or checked on a GPU (session 8): opt-in only
    tail: int = 0
    # "tcg" swap, ws 0: stream-K schedule (gemm_wna16_tcg_streamk.py: one CTA per SM, whole waves of tiles
    # data-parallel, the leftover tiles' K steps spread evenly over every CTA; split_k unused). 1: tiles shared by
    # several CTAs summed by the ticketed in-kernel reduction, the others stored directly; 2: every partial by fp32
    # atomics into a zeroed y (cast after); 3: as 1 but a thin leftover (<= 1/3 wave) does not take the last whole
    # wave into stream-K (gemm_wna16_tcg_streamk.plan fold=False: fewer shared tiles; same kernel, another grid
    # plan; session 11, not yet GPU-timed: opt-in). "mv" / "mvs" (gemm_wna16_small._mv_kernel, split_k 1): S > 0 =
    # a persistent grid of S programs per SM, each a contiguous range of the N tiles' K blocks laid end to end
    # (stream-K, as Humming's small-M Hopper schedule: fewer, longer programs than split-K's grid, at most a few
    # partials per tile; session 25, CPU-checked only: a tune candidate)
    streamk: int = 0
    # "tcg" swap with the ticketed split-K sum (reduce, or streamk 1 / 3): 1 = the last split of a tile adds its own
    # partial from registers instead of reloading its workspace slab (gemm_wna16_tcg._swap_store OWN; session 11,
    # compiled offline, not GPU-checked: opt-in)
    fixup_own: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ComputeConfig":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def valid_for(self, layer: LayerConfig) -> bool:
        k_steps = -(-layer.k // layer.spec.k_multiple)
        if (self.kernel not in ("gemv", "mv", "mvs", "stream", "dot", "dequant_mm", "tc", "tcg") or self.block_n < 16
                or self.split_k < 1):
            return False
        if self.kernel == "tcg":  # gemm_wna16_tcg.py: symmetric int4 g128 bf16 scales (swap: or MXFP4), whole
            sp = layer.spec  # tiles, no empty split
            steps = layer.k // 128
            per = -(-steps // self.split_k)
            int4 = (sp.is_int and sp.weight_bits == 4 and not sp.has_zero_point and sp.group_size == 128
                    and sp.scale_dtype == "bf16")
            mxfp4 = (self.swap and sp.weight_dtype == "fp4_e2m1" and sp.group_size == 32 and sp.scale_dtype == "e8m0"
                     and not sp.global_scale)
            return ((int4 or mxfp4) and layer.k % 128 == 0 and self.block_n in (64, 128, 256)
                    and layer.n % self.block_n == 0 and self.block_m in (64, 128, 256) and self.num_warps in (4, 8, 16)
                    and self.num_stages >= 2 and (self.split_k - 1) * per < steps
                    # swap (W as the wgmma A operand): warps along the tile's weight rows, 16 each
                    and (not self.swap or self.block_n % (16 * self.num_warps) == 0)
                    # ws 1: loader warp; ws 2: also the two warpgroups in their own partitions (half a tile each)
                    and (self.ws == 0 or self.swap) and (self.ws != 2 or (self.num_warps == 8 and self.block_n >= 128))
                    # swap with 256 x rows (wgmma N = 256): correct at 2 stages (147 KB of shared memory), NaN in
                    # ~9-57 % of y at 3 stages (209-221 KB; bench/wna16_tcg_diag.py, H200 session 5 R1): 2 only.
                    # Measured with the K loop's register-A race (fixed in session 10), likely the same cause:
                    # not re-checked on the GPU yet
                    and not (self.swap and self.block_m > 128 and (self.num_stages > 2 or self.ws))
                    # reduce: the in-kernel split-K sum of the swap kernel without the loader warp
                    and (not self.reduce or (self.swap and self.ws == 0 and self.split_k > 1))
                    and (not self.tail or self.reduce)
                    # streamk 1 with the 128x128 8-warp tile was wrong on every tile in session 9: the K loop's
                    # register-A race (gemm_wna16_tcg._swap_kloop), fixed in session 10
                    and (not self.streamk or (self.swap and self.ws == 0 and not self.tail and self.split_k == 1
                                              and self.streamk in (1, 2, 3)))
                    # fixup_own on 128x256 spills 176-536 B (offline sm_90a compile, session 11): 128-wide only
                    and (not self.fixup_own or (self.block_n <= 128 and (self.reduce or self.streamk in (1, 3)))))
        if self.streamk and self.kernel in ("mv", "mvs"):
            return (self.split_k == 1 and 1 <= self.streamk <= 8
                    and (self.block_m in (8, 16) if self.kernel == "mvs" else self.block_m >= 16))
        if self.streamk:
            return False
        if self.kernel == "tc":  # block_k: K step, 0 or a power-of-two multiple of the planar block
            kb = max(1, self.block_k // layer.spec.k_multiple)
            if self.block_m < 16 or self.block_k % layer.spec.k_multiple or kb & (kb - 1):
                return False
            return -(-k_steps // kb) >= self.split_k
        if self.kernel == "dequant_mm" and (self.block_k < 16 or self.block_k & (self.block_k - 1) or self.chunks < 1):
            return False
        if self.kernel in ("dot", "mv") and self.block_m < 16:
            return False
        if self.kernel == "mvs" and self.block_m not in (8, 16):  # mvs: x is the MMA's N side, 8 is an MMA shape
            return False
        if self.kernel == "stream" and self.block_m not in (1, 2, 4):
            return False
        return k_steps >= self.split_k


def m_bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def user_cache_path() -> Path:
    return Path(os.environ.get("KESTREL_TUNE_CACHE", Path.home() / ".cache" / "kestrel" / "tune.json"))


def cache_key(gpu: str, layer: LayerConfig, bucket: int) -> str:
    return f"{gpu}|{layer.key}|m{bucket}"


@lru_cache(maxsize=8)
def _read_cache(path: str, mtime: float) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def load_cache(path: Path) -> dict:
    try:
        return _read_cache(str(path), path.stat().st_mtime)
    except OSError:
        return {}


def store_cache(path: Path, entries: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(load_cache(path))
    data.update(entries)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def heuristic(layer: LayerConfig, m: int, num_sms: int = 132) -> ComputeConfig:
    """Shape-class defaults (used when no tuned entry exists)."""
    def fit_bk(bk: int) -> int:
        while bk > 16 and layer.k % bk:
            bk //= 2
        return bk

    if m <= 16:  # decode (gemm_wna16_small.py); H200 sweep (bench/results/gemm_wna16.md): split-K up to 16
        k_steps = -(-layer.k // layer.spec.k_multiple)
        # round-1 sweep 2026-12-02 ~20:50: mv with 128-wide tiles and 2 warps won all 16 (shape, M in {1, 16})
        # points, M = 1 included (gemv 1.1-1.6x slower), at split 2-8 (~4 programs per SM)
        bn = 128 if layer.n >= 2048 else 64
        split = max(1, min(_pow2_floor(max(1, 4 * num_sms // -(-layer.n // bn))), k_steps // 2, 16))
        return ComputeConfig("mv", 16, bn, 0, split, num_warps=2, num_stages=3)
    # int weights at M <= 256: the tc kernel. Sub-wave grids (< ~0.75 waves of 128x128 tiles) without split-K lost
    # to dequant + cuBLAS (H200 2026-12-03, M = 256: 8B down tc s4 135.2 us, dequant + cuBLAS 89.5), but split over
    # K at 2 stages they win (8B down tc 128x128 split 4 s2 79.7 us, bench/wna16_config_probe.py): heuristic_tc
    if m <= 256 and (tcg := heuristic_tcg(layer, m, num_sms)) is not None:
        return tcg
    if m <= 64 or (m <= 256 and layer.spec.is_int):
        return heuristic_tc(layer, m, num_sms)
    # M > 256 (and M > 64 for minifloat weights): dequant pass + cuBLAS. H200 round 1 of 2026-12-03
    # (bench/results/gemm_wna16_largem.md): one pass beat the tc kernel at M = 1024/4096 on every measured shape
    # (1.2-1.4x) and at M = 256 for mxfp4; overlapping the pass with cuBLAS in column blocks (chunks) did not win
    # beyond noise, so chunks stay a tuner candidate
    return ComputeConfig("dequant_mm", 1, 64, fit_bk(128), 1, num_warps=4, num_stages=1)


def heuristic_tcg(layer: LayerConfig, m: int, num_sms: int = 132) -> ComputeConfig | None:
    """16 < M <= 256, symmetric int4 g128 (bf16 scales) or MXFP4: the swap-AB Gluon kernel (gemm_wna16_tcg.py, W
    decoded into the wgmma A registers; the tc kernel with the same tile off Hopper). H200 probe of 2026-12-03
    session 4 round 1 (bench/results/gemm_wna16_largem.md): M <= 64 64x128 w8 s4 (int4 8B down 24.5 vs 26.5 us for
    the session-3 winner, 70B o 24.6 vs 29.5; MXFP4 31.3 vs 34.9 and 28.3 vs 38.6), split over K to the split
    nearest 1.5 waves (70B o: split 4, 24.6 us; split 2, 27.7); M <= 256 128x128 w8 s4 split nearest one wave
    (8B down split 2 57.2 vs 66.3, 70B o split 1 57.4 vs 68.1; MXFP4 66.8 vs 91.0, 72.2 vs 94.2). The loader-warp
    variants (ws 1 / 2) were 2-35 % slower on each of these points."""
    bm, bn, st, waves = (64, 128, 4, 1.5) if m <= 64 else (128, 128, 4, 1.0)
    tiles = -(-m // bm) * -(-layer.n // bn)
    best = None
    for sk in (1, 2, 4, 8):
        cfg = ComputeConfig("tcg", bm, bn, 0, sk, num_warps=8, num_stages=st, swap=True)
        if cfg.valid_for(layer) and (best is None or abs(math.log2(tiles * sk / (waves * num_sms))) <
                                     abs(math.log2(tiles * best.split_k / (waves * num_sms)))):
            best = cfg
    return best


def heuristic_tc(layer: LayerConfig, m: int, num_sms: int = 132) -> ComputeConfig:
    """16 < M <= 256: the tensor-core "tc" kernel (gemm_wna16_tc.py) with 8-warp 128-wide tiles (vector smem stores,
    paired packed decode). From the H200 round-1 sweep of 2026-12-03 (bench/results/gemm_wna16_largem.md):
    - M <= 64: 64x128, 3 stages, split-K up to ~2 CTAs per SM (each split >= 8 K steps): 70B o 40.3 -> 36.6 us at
      split 4; the decode and the wgmma of one CTA serialise, so a second CTA per SM is the overlap.
    - M <= 256: 128x128; 4 stages while the tiles fit one wave (one CTA per SM anyway: 70B o 119.9 -> 80.3 us,
      8B qkv 61.6 -> 41.7), else 2 stages so two CTAs share an SM (8B gate_up: 141.8 us at 2 stages, 161.9 at 4).
      Split-K lost at M = 256 on grids of >= ~1 wave; below ~0.75 waves 2 stages + split-K to ~2 CTAs per SM won
      (8B down M = 256: 128x128 split 4 s2 79.7 us vs 135.2 at s4 unsplit, 2026-12-03 session-2 probe)."""
    k_steps = -(-layer.k // layer.spec.k_multiple)
    if m <= 64:
        tiles = -(-layer.n // 128)
        split = 1
        while tiles * split * 2 <= 2 * num_sms and split < 8 and k_steps // (split * 2) >= 8:
            split *= 2
        return ComputeConfig("tc", 64, 128, 0, split, num_warps=8, num_stages=3)
    tiles = -(-m // 128) * -(-layer.n // 128)
    if tiles < 0.75 * num_sms:  # sub-wave grid: split K to ~2 CTAs per SM at 2 stages (each split >= 8 K steps)
        split = 1
        while tiles * split * 2 <= 2 * num_sms and split < 8 and k_steps // (split * 2) >= 8:
            split *= 2
        return ComputeConfig("tc", 128, 128, 0, split, num_warps=8, num_stages=2)
    return ComputeConfig("tc", 128, 128, 0, 1, num_warps=8, num_stages=4 if tiles <= num_sms else 2)


@dataclass(frozen=True)
class TuningConfig:
    """Per-GPU choice of ComputeConfig."""
    gpu: str

    def lookup(self, layer: LayerConfig, m: int) -> ComputeConfig:
        # memoised per cache-file version: the launch path must not re-scan JSON on every call
        up = user_cache_path()
        stamp = tuple(p.stat().st_mtime if p.exists() else 0.0 for p in (up, PACKAGED_CACHE))
        key = (self.gpu, layer, m_bucket(m), str(up), stamp)
        if key not in _MEMO:
            if len(_MEMO) > 4096:
                _MEMO.clear()
            _MEMO[key] = self._lookup(layer, m)
        return _MEMO[key]

    def _lookup(self, layer: LayerConfig, m: int) -> ComputeConfig:
        """Exact (GPU, format, N, K, M bucket) entry; else the tuned entry of the nearest shape of the same
        GPU/format/M bucket (shape class); else the heuristic. The user cache wins over the packaged one."""
        caches = [load_cache(p) for p in (user_cache_path(), PACKAGED_CACHE)]
        # M > 16: exact entries only. A neighbour's tc tile/stages/split depend on its own wave count: on the H200
        # (2026-12-03 round 2) 70B o's M=256 entry cost 70B qkv 156.5 us and 8B down 135.2 us, 8B qkv's M=64 entry
        # cost 8B o 27.2 us (18.9 with the heuristic's tile class on 2026-12-02)
        entry = nearest_shape_entry(caches, self.gpu, layer.spec.name, layer.n, layer.k, m_bucket(m),
                                    max_dist=2.0 if m <= 16 else 0.0,
                                    accept=lambda e: _config_of(e, layer) is not None)
        return heuristic(layer, m) if entry is None else _config_of(entry, layer)


_MEMO: dict = {}


def _config_of(entry, layer: LayerConfig) -> ComputeConfig | None:
    if entry is None:
        return None
    try:
        cfg = ComputeConfig.from_dict(entry["config"] if "config" in entry else entry)
    except (TypeError, KeyError):
        return None
    return cfg if cfg.valid_for(layer) else None


# ---- generic tune-cache helpers (shared by the low-bit GEMMs' cache in lowbit_tune.py; same key format as above)

def shape_key(gpu: str, name: str, n: int, k: int, bucket: int) -> str:
    """key of a (GPU, kernel or format name, N, K, M bucket) entry: what cache_key writes for a LayerConfig."""
    return f"{gpu}|{name}|n{n}|k{k}|m{bucket}"


def nearest_shape_entry(caches: list[dict], gpu: str, name: str, n: int, k: int, bucket: int,
                        max_dist: float = 2.0, accept=lambda entry: True):
    """The exact entry from the first cache holding one; else the entry of the nearest shape (|log2 dN| + |log2 dK|
    <= max_dist) with the same GPU, name and M bucket; else None. `accept` filters unusable entries."""
    key = shape_key(gpu, name, n, k, bucket)
    for cache in caches:
        if key in cache and accept(cache[key]):
            return cache[key]
    best, best_d = None, float("inf")
    prefix, suffix = f"{gpu}|{name}|", f"|m{bucket}"
    for cache in caches:
        for k2, v in cache.items():
            if k2.startswith(prefix) and k2.endswith(suffix):
                try:
                    n2, kk2 = (int(t[1:]) for t in k2[len(prefix):-len(suffix)].split("|"))
                except ValueError:
                    continue
                d = abs(math.log2(n2 / n)) + abs(math.log2(kk2 / k))
                if d < best_d and accept(v):
                    best, best_d = v, d
    return best if best_d <= max_dist else None
