# Issue #3, small M (decode). Sourced by run.sh. Decides: FOLD_S1, INT_XSUM, FOLD_BIAS_WORDS and pair-word packing
# become defaults only if their GPU tests pass AND they beat the current default in the same process.
P="python3 -m pytest -q -p no:cacheprovider"
# 1. the opt-in paths the CPU interpreter cannot execute (inline PTX: fold at num_stages 1, bias words, x-sum, pairs)
stage tests 120 $P tests/test_gemm_wna16.py -k "fold or scale_words or group_rows or prefetch or xsum or pair or ptx"
# 2. same-process A/B vs the default and Humming on the 8 Llama-3 shapes, M 1..16 (every config checked vs x @ W^T)
L=llama3-70b:gate_up,llama3-70b:down,llama3-70b:qkv,llama3-70b:o,llama3-8b:gate_up,llama3-8b:down,llama3-8b:qkv,llama3-8b:o
stage ab_fp4 120 python3 bench/wna16_mvs8_sweep.py --ms 16,8,4,1 --formats mxfp4 --workers 12 --budget-s 90 --no-mvs8 \
  --ab bias,mul16,fold-s1,fold-s1+bias,pairw,pairadj,pairadj+bias --ab-tiles 64:1,128:4 --layers $L \
  --humming mxfp4:llama3-70b:gate_up,mxfp4:llama3-8b:qkv --out $OUT/decode/ab_fp4
stage ab_int4 100 python3 bench/wna16_mvs8_sweep.py --ms 16,8,4,1 --formats int4 --workers 12 --budget-s 75 --no-mvs8 \
  --ab xsum,pairw,pairadj,xsum+pairadj --ab-tiles 64:1,128:4 --layers $L \
  --humming int4:llama3-70b:gate_up,int4:llama3-8b:qkv --out $OUT/decode/ab_int4
# 3. the headline table with the session-10 defaults (not re-run since)
stage headline 90 python3 bench/gemm_wna16.py --ms 1,4,16 --formats mxfp4,int4 --peers humming,cublas --no-dobench \
  --warm-workers 8 --no-warm-humming --warm-humming-threads 4 --budget-s 60 --out $OUT/decode/headline
