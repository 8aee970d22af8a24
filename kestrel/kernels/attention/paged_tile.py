"""Load one tile of keys/values from the paged KV cache: positions -> block table -> slots. Shared by the prefill
and decode kernels so the paging arithmetic lives in one place."""
import triton
import triton.language as tl


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, stride_bt, pos, n_mask, kvh, offs_d, d_mask,
                 NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """K and V [len(pos), BLOCK_D] of kv head `kvh` at token positions `pos` of sequence `seq` (masked rows = 0)."""
    blk = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    slot = blk * BLOCK_SIZE + pos % BLOCK_SIZE
    kv_off = (slot * NUM_KV_HEADS + kvh)[:, None] * HEAD_DIM + offs_d[None, :]
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    return k, v
