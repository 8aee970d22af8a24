# After a round's flips (session 15: FOLD_BIAS_WORDS, INT_XSUM, KESTREL_MOE_TCG_LOOP=2 on; H100 tune entries):
# the headline tables with the new defaults, every row checked against x @ W^T (kestrel_err). Sourced by run.sh.
stage headline 110 python3 bench/gemm_wna16.py --ms 1,4,16 --formats mxfp4,int4 --peers humming,cublas --no-dobench \
  --warm-workers 8 --no-warm-humming --warm-humming-threads 4 --budget-s 90 --out $OUT/confirm/headline
stage moe_layer 60 python3 bench/moe.py --models qwen3-30b-a3b,mixtral-8x7b --ms 1024 --formats int4 --lean \
  --budget-s 50 --out $OUT/confirm/moe_layer
