# Issue #3, large M (tensor-core Gluon kernels). Sourced by run.sh. Decides: ws 1 / 2 on the race-free swap loop,
# stream-K 3 and fixup_own as defaults / tuner picks, only where right and faster than the session-10 picks.
P="python3 -m pytest -q -p no:cacheprovider"
stage tests 120 $P tests/test_gemm_wna16_tc.py -k "gluon or streamk or tail or reduce"
S="10240,8192;8192,8192;57344,8192;8192,28672;6144,4096;4096,4096;28672,4096;4096,14336"
for f in int4 mxfp4; do  # --ab-default: the current pick in the same process; every config checked vs x @ W^T
  stage probe_${f}_m256 60 python3 bench/wna16_config_probe.py --format $f --shapes "$S" --ms 256 --jobs 14 --ab-default \
    --configs tcg,128,128,0,1,8,3,swap,streamk=1 tcg,128,128,0,1,8,3,swap,streamk=3 \
    tcg,128,128,0,1,8,3,swap,streamk=1,fixup_own=1 tcg,128,128,0,1,8,3,swap,streamk=3,fixup_own=1 \
    tcg,128,128,0,1,8,4,swap,ws=1 tcg,128,128,0,1,8,4,swap,ws=2 tcg,64,128,0,1,8,4,swap,ws=2
done
stage vs_humming 120 python3 bench/wna16_largem_vs_humming.py --formats int4,mxfp4 --ms 256,1024 --jobs 14 --budget-s 100 \
  --out $OUT/largem/vs_humming
