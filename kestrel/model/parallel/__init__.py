"""Tensor / expert / data parallelism over torch.distributed (NCCL on GPUs, gloo on the CPU)."""
from .distributed import NCCL_SAFE_ENV, ParallelGroup, apply_nccl_env, destroy_distributed, init_distributed
from .linear import ColumnParallelLinear, RowParallelLinear, column_shard, row_shard
from .shard_llama import check_tp_size, heads_per_rank, shard_llama
from .vocab import ParallelLMHead, VocabParallelEmbedding

__all__ = ["NCCL_SAFE_ENV", "ParallelGroup", "apply_nccl_env", "destroy_distributed", "init_distributed",
           "ColumnParallelLinear", "RowParallelLinear", "column_shard", "row_shard", "check_tp_size",
           "heads_per_rank", "shard_llama", "ParallelLMHead", "VocabParallelEmbedding"]
