"""Tensor / expert / data parallelism over torch.distributed (NCCL on GPUs, gloo on the CPU)."""
from .distributed import NCCL_SAFE_ENV, ParallelGroup, apply_nccl_env, destroy_distributed, init_distributed
from .linear import ColumnParallelLinear, RowParallelLinear, column_shard, row_shard
from .shard_llama import check_tp_size, heads_per_rank, shard_llama
from .vocab import ParallelLMHead, VocabParallelEmbedding

__all__ = ["NCCL_SAFE_ENV", "ParallelGroup", "apply_nccl_env", "destroy_distributed", "init_distributed",
           "ColumnParallelLinear", "RowParallelLinear", "column_shard", "row_shard", "check_tp_size",
           "heads_per_rank", "shard_llama", "ParallelLMHead", "VocabParallelEmbedding"]
from .dp_attention import DPGatheredMLP, dp_generate, empty_forward  # noqa: E402
from .eplb import ExpertPlacement, contiguous_placement, plan_placement  # noqa: E402
from .moe import ExpertParallelMoE, ParallelQwenMoeBlock, expert_parallelize  # noqa: E402

__all__ += ["DPGatheredMLP", "dp_generate", "empty_forward", "ExpertPlacement", "contiguous_placement",
            "plan_placement", "ExpertParallelMoE", "ParallelQwenMoeBlock", "expert_parallelize"]
