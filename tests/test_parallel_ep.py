"""Expert parallelism on the CPU: EP=2 over gloo (two forked ranks) with data-parallel attention, against a
single-process run of the same tiny random MoE Llama. Layer level: EP outputs (with and without replicated hot
experts, before and after a rebalance) against a dense per-token reference written here; model level: greedy
tokens identical to EP=1 when each rank serves its own share of the prompts (one rank runs out of work early and
joins the collectives with empty steps)."""
import pytest
import torch
import torch.nn.functional as F

from parallel_helpers import make_tiny_llama, run_ranks

from kestrel.engine import EngineConfig, LLMEngine, SamplingParams
from kestrel.model.parallel import (ColumnParallelLinear, DPGatheredMLP, ExpertParallelMoE, ParallelGroup,
                                    RowParallelLinear, contiguous_placement, dp_generate, init_distributed,
                                    plan_placement)

E, I, TOP_K, H = 4, 32, 2, 64
PROMPTS = [[1, 504, 308, 314, 725, 30, 253, 789], [1, 47, 990, 19, 31], [1, 887, 314, 260, 130, 282, 406] * 2]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def expert_weights(layer: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed + layer)
    return (torch.randn(E, H, generator=g) * 0.5, torch.randn(E, 2 * I, H, generator=g) * 0.2,
            torch.randn(E, H, I, generator=g) * 0.2)


def dense_moe_reference(x, router, w13, w2):
    """Per token: softmax over experts, top-k, renormalize, SwiGLU expert outputs summed with those weights."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        p = torch.softmax(x[t] @ router.t(), -1)
        w, ids = p.topk(TOP_K)
        for wi, e in zip((w / w.sum()).tolist(), ids.tolist()):
            h = w13[e] @ x[t]
            out[t] += wi * (w2[e] @ (F.silu(h[:I]) * h[I:]))
    return out


def install_moe(model, group, placement=None):
    for i, layer in enumerate(model.layers):
        router, w13, w2 = expert_weights(i)
        layer.mlp = ExpertParallelMoE(router, w13, w2, TOP_K, group, placement=placement)


def _layer_checks(rank, world, init_method):
    group, _ = init_distributed(rank, world, init_method)
    router, w13, w2 = expert_weights(0)
    x = torch.randn(6 if rank == 0 else 3, H, generator=torch.Generator().manual_seed(rank))
    ref = dense_moe_reference(x, router, w13, w2)
    moe = ExpertParallelMoE(router, w13, w2, TOP_K, group)
    out = {"contiguous": moe(x)}
    hot = plan_placement([100, 5, 5, 5], world, num_redundant=2)  # expert 0 gets a copy on both ranks
    out["replicated"] = ExpertParallelMoE(router, w13, w2, TOP_K, group, placement=hot)(x)
    out["rebalanced"] = (moe.rebalance(num_redundant=2), moe(x))[1]
    out["empty"] = moe(x[:0] if rank == 1 else x)  # rank 1 brings no tokens
    # tensor-parallel dense MLP behind data-parallel attention: rank 1 again has no tokens
    g = torch.Generator().manual_seed(3)
    up, down = torch.nn.Linear(H, 96, bias=False), torch.nn.Linear(96, H, bias=False)
    up.weight.data, down.weight.data = torch.randn(96, H, generator=g) * 0.1, torch.randn(H, 96, generator=g) * 0.1
    tp_mlp = torch.nn.Sequential(ColumnParallelLinear.from_full(up, group), torch.nn.ReLU(),
                                 RowParallelLinear.from_full(down, group))
    xm = x if rank == 0 else x[:0]
    mlp_out = DPGatheredMLP(tp_mlp, group)(xm)
    return ref, out, (mlp_out, down(torch.relu(up(xm))))


def test_ep2_moe_layer_matches_dense_reference():
    res = run_ranks(_layer_checks, 2)
    for rank, (ref, outs, (mlp_out, mlp_ref)) in res.items():
        for name, y in outs.items():
            want = ref[:0] if (name == "empty" and rank == 1) else ref
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")
        torch.testing.assert_close(mlp_out, mlp_ref, rtol=1e-5, atol=1e-5)


def test_eplb_placement_balances_hot_experts():
    load = [400, 30, 20, 10, 10, 10, 10, 10]
    hot = plan_placement(load, num_ranks=4, num_redundant=4)
    reps = hot.replicas()
    assert all(len(r) >= 1 for r in reps) and len(reps[0]) == 4  # the hottest expert is on every rank
    for r in range(4):
        local = hot.local_experts(r)
        assert len(local) == 3 and len(set(local)) == 3  # no rank holds two copies of one expert
    assert max(hot.rank_loads(load)) < max(contiguous_placement(8, 4).rank_loads(load))
    with pytest.raises(ValueError):
        plan_placement(load, num_ranks=3, num_redundant=0)  # 8 slots cannot split over 3 ranks


@pytest.fixture(scope="module")
def tiny_moe_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-moe"))
    make_tiny_llama(path, seed=3)
    return path


def _config(path):
    return EngineConfig(model=path, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, progress=False)


def _ep_rank(rank, world, init_method, path):
    group, _ = init_distributed(rank, world, init_method)
    engine = LLMEngine(_config(path))
    install_moe(engine.model, group)
    mine = PROMPTS[rank::world]  # data-parallel attention: each rank serves its own requests
    first = [o.output_token_ids for o in dp_generate(engine, mine, GREEDY, group)]
    for layer in engine.model.layers:  # EPLB: replicate the hot experts seen so far, then serve again
        layer.mlp.rebalance(num_redundant=2)
    again = [o.output_token_ids for o in dp_generate(engine, mine, GREEDY, group)]
    return first, again


def test_ep2_dp_attention_greedy_matches_ep1(tiny_moe_path):
    ref_engine = LLMEngine(_config(tiny_moe_path))
    install_moe(ref_engine.model, ParallelGroup())
    ref = [o.output_token_ids for o in ref_engine.generate(PROMPTS, GREEDY)]
    res = run_ranks(_ep_rank, 2, tiny_moe_path)
    for rank, (first, again) in res.items():
        assert first == ref[rank::2]
        assert again == ref[rank::2]
