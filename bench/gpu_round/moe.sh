# Issue #4 (MoE grouped GEMM, W8A8, W4A8). Sourced by run.sh. Decides: KESTREL_MOE_TCG_LOOP=2 (race-free) becomes the
# default if right and within ~1 % of LOOP 0; PERSIST 2 if faster; the M=64 K splits of W4A8 / FP8 W8A8.
P="python3 -m pytest -q -p no:cacheprovider"
stage tests 110 $P tests/test_moe_tcg_gpu.py tests/test_moe.py
stage tests_lowbit 60 $P tests/test_gemm_w8a8.py tests/test_gemm_w4a.py -k "split or tma or m64 or asm"
for loop in 0 2; do  # same bench, the K loop flipped by env (one process each; Humming in both as the anchor)
  stage layer_loop$loop 90 env KESTREL_MOE_TCG_LOOP=$loop python3 bench/moe.py --models qwen3-30b-a3b,mixtral-8x7b \
    --ms 1024 --formats int4 --lean --budget-s 70 --out $OUT/moe/layer_loop$loop
done
for s in 1 2 4; do
  stage lowbit_split$s 60 env KESTREL_W4A8_SPLIT=$s KESTREL_W8A8_SPLIT=$s python3 bench/gemm_w8a8.py --lean \
    --sections fp8,w4a8 --shapes 4096x14336,8192x28672,28672x4096 --ms 64 --budget-s 45 --out $OUT/moe/lowbit_split$s
done
