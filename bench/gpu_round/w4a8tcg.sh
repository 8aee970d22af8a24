# Issue #4, sessions 21-22: the Gluon W4A8 kernel's tiles (256 tokens in two halves / 128, split 1 / 2 / 4) and consumer
# options (kh, pp ping-pong, pk permuted-K decode) beside Humming W4A8 and the default path; the permuted quant.
# Sourced by run.sh.
P="python3 -m pytest -q -p no:cacheprovider"
if [ "${TCG_TESTS:-1}" = 1 ]; then  # TCG_TESTS_K: a pytest -k selection
  if [ -n "${TCG_TESTS_K:-}" ]; then stage tests ${TCG_TESTS_S:-180} $P tests/test_gemm_w4a8_tcg.py -k "$TCG_TESTS_K"
  else stage tests ${TCG_TESTS_S:-180} $P tests/test_gemm_w4a8_tcg.py; fi
fi
# session 22: quant_fp8(perm=True) (the PK decode's activations) beside the plain quant; TCG_PK waits on it
[ "${TCG_QUANT:-1}" = 1 ] && stage quant ${TCG_QUANT_S:-60} python3 bench/act_quant_sweep.py --ms 256,1024,4096 \
  --ks 14336,28672 --block-max 16384 --chunk-programs 264 --out $OUT/w4a8tcg/quant.json
# the Gluon W4A8 tiles tuned first (off by default: TCG_TUNE=1), winners written under $OUT for
# bench/merge_tune_cache.py --lowbit, and the lean bench below then reads them (the defaults it times are the tuned ones)
if [ "${TCG_TUNE:-0}" = 1 ]; then
  export KESTREL_LOWBIT_TUNE_CACHE=$OUT/w4a8tcg/lowbit_tune.json
  stage tune ${TCG_TUNE_S:-200} python3 -m kestrel.cli tune --lowbit w4a8tcg-int4 --lowbit w4a8tcg-mxfp4 \
    $(for m in ${TCG_TUNE_MODELS:-llama3-70b}; do echo --model $m; done) --m ${TCG_TUNE_MS:-256,1024,4096}
fi
LS=${TCG_LEAN_S:-330}
stage lean $LS python3 bench/gemm_w8a8.py --lean --sections ${TCG_SECTIONS:-w4a8,w4a8mx} --shapes ${TCG_SHAPES:-8192x28672,4096x14336} \
  --ms ${TCG_MS:-256,1024,4096,64} --deadline-s $(( LS - 20 )) --out $OUT/w4a8tcg/lean
# FP8 W8A8 at M = 64 (the one point short of Humming W8A8): the in-kernel split-K TMA tiles (session 17, opt-in)
[ "${TCG_FP8:-1}" = 1 ] && stage fp8m64 ${TCG_FP8_S:-130} python3 bench/gemm_w8a8.py --lean --sections fp8 \
  --shapes 4096x14336,8192x28672 --ms 64,16 --fp8-cfgs 64:64:2:4:6,64:64:4:4:6,64:32:1:4:6,64:32:2:4:6 \
  --deadline-s $(( ${TCG_FP8_S:-130} - 15 )) --out $OUT/w4a8tcg/fp8m64
# a profile of the Gluon kernels (ncu if the image has it and may read the counters)
if [ "${TCG_PROF:-1}" = 1 ]; then
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  echo "ncu: ${NCU:-none}"
  if [ -n "$NCU" ]; then
    TAIL=200 stage prof ${TCG_PROF_S:-120} $NCU --kernel-name regex:_w4a8 --launch-skip 2 --launch-count 2 --section SpeedOfLight \
      --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      python3 bench/w4a8_tcg_profile.py --m 4096 --iters 1
  else
    stage prof 60 python3 bench/w4a8_tcg_profile.py --m 4096
  fi
fi
