# Issue #4 (W8A8 / W4A8), session 17's unmeasured changes. Sourced by run.sh. Decides: act_quant.BLOCK_MAX (16384 if
# faster: the 32768 one-trip block spills offline), whether the PDL pair up to gemm_w8a8.PDL_MAX_M = 64 holds at
# M = 256, and the MXFP4 scale folds' defaults (KESTREL_W4A8_FOLD_MIN_M / KESTREL_W4A8_FOLD_KERNEL).
P="python3 -m pytest -q -p no:cacheprovider"
[ "${W8A8_TESTS:-1}" = 1 ] && stage tests 60 $P tests/test_gemm_w4a.py tests/test_act_quant.py -k "fold or quant"
[ "${W8A8_QUANT:-1}" = 1 ] && stage quant 50 python3 bench/act_quant_sweep.py --ms 16,64,256,1024 --ks 14336,28672 --block-max 16384,32768 \
  --chunk-programs 264 --out $OUT/w8a8/act_quant.json
# W8A8_SECTIONS / _SHAPES / _MS / _LEAN_S narrow the lean stage (W8A8_TESTS=0 / W8A8_QUANT=0 skip the first two)
LS=${W8A8_LEAN_S:-150}
stage lean $LS python3 bench/gemm_w8a8.py --lean --sections ${W8A8_SECTIONS:-fp8,w4a8,w4a8mx} \
  --shapes ${W8A8_SHAPES:-4096x14336,8192x28672} --ms ${W8A8_MS:-64,256,1024,4096} --deadline-s $(( LS - 20 )) \
  --out $OUT/w8a8/lean
