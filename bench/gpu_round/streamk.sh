# Issue #3, session 25: the mv kernel's stream-K grid (ComputeConfig.streamk, a tune candidate not yet GPU-run):
# its tests compiled on the GPU (the inline-PTX decodes the CPU interpreter does not run), then the same-process
# sweep against the config each layer runs today; its winners (stream_k_tune.json) go into the packaged cache
# with bench/merge_tune_cache.py --gpu "<GPU name>" only where they beat it. Sourced by run.sh.
P="python3 -m pytest -q -p no:cacheprovider"
stage tests ${SK_TESTS_S:-90} $P tests/test_gemm_wna16.py -k stream_k
SS=${SK_SWEEP_S:-200}
stage sweep $SS python3 bench/wna16_streamk_sweep.py --ms ${SK_MS:-1,4,16} --formats ${SK_FORMATS:-int4,mxfp4} \
  --budget-s $(( SS - 40 )) --out $OUT/streamk
