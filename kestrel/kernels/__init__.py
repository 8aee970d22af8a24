"""Triton JIT kernels (GEMM, MoE GEMM, attention) + layer/compute/tuning configs + tune cache."""
