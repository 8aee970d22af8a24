"""Self-check of the captured prefill graphs against the engine's eager prefill, bucket by bucket, at capture time.

Why: the prefill graphs (prefill_graphs.py) are CPU-tested as a padded eager step, but the captured replay itself
only runs on a GPU, where a capture can go wrong in ways the CPU cannot show (a kernel choosing its config from a
host value baked in at capture, an allocation outside the graph pool, a padding write that lands somewhere real).
So before a bucket's graph serves any request, it is replayed once on a warm-up chunk and compared with the eager
prefill of the same chunk: the last token's logits and hidden state within a tolerance, and the chunk's K/V equal
at its real slots. A bucket that raises or differs is dropped (its chunks then take the next larger bucket that
passed, or the eager prefill), logged once. The K/V blocks the check writes are restored afterwards.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# |graph - eager| <= atol + rtol * max|eager|: padding changes the GEMMs' M (other kernel configs, other rounding),
# a real fault (a misplaced query, a leaked padding key, stale inputs) changes the logits by O(max|logit|)
TOLERANCE = {torch.float32: (1e-2, 1e-3), torch.bfloat16: (3e-2, 1e-2), torch.float16: (3e-2, 1e-2)}
CONTEXT = 5  # warm-up chunks sit on 5 cached tokens: a partial first block, real queries off position 0


def _within(got: torch.Tensor, ref: torch.Tensor, dtype) -> tuple[bool, float]:
    rtol, atol = TOLERANCE.get(dtype, TOLERANCE[torch.bfloat16])
    got, ref = got.float(), ref.float()
    if not bool(torch.isfinite(got).all()):
        return False, float("inf")
    diff = float((got - ref).abs().max())
    return diff <= atol + rtol * float(ref.abs().max()), diff


@torch.inference_mode()
def check_prefill_graphs(pg, eager, vocab_size: int, seed: int = 0) -> dict:
    """Replay each bucket of pg (a captured PrefillCudaGraphs) on a warm-up chunk and compare with eager(token_ids,
    start, block_table) -> (logits [1, V], hidden [1, H]) of the chunk's last token (the engine's eager prefill,
    storing the chunk's K/V like the graph does). The chunk is the bucket's worst padding: one token more than the
    next smaller bucket, on CONTEXT cached tokens. Drops failing buckets from pg (graph, output, bucket list).
    Returns {bucket: {"ok", "logit_diff", "hidden_diff", "kv_ok", "error"}} (also kept as pg.check)."""
    g = torch.Generator().manual_seed(seed)
    bs, dtype = pg.block_size, pg.k_caches[0].dtype
    report, prev = {}, 0
    for S in list(pg.buckets):
        n = prev + 1
        prev = S
        ids = torch.randint(1, vocab_size, (CONTEXT + n,), generator=g).tolist()
        table = list(range(-(-(CONTEXT + n) // bs)))
        if len(table) > pg.k_caches[0].shape[0]:
            report[S] = dict(ok=False, error=f"cache of {pg.k_caches[0].shape[0]} blocks too small to check")
            continue
        saved = [(k[table].clone(), v[table].clone()) for k, v in zip(pg.k_caches, pg.v_caches)]
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(CONTEXT, CONTEXT + n)], device=pg.dev)
        r = dict(ok=False, logit_diff=None, hidden_diff=None, kv_ok=None, error=None)
        try:
            eager(ids[:CONTEXT], 0, table)  # the cached context, stored the eager way
            ref_logits, ref_hidden = (t.clone() for t in eager(ids[CONTEXT:], CONTEXT, table))
            ref_kv = [(k.flatten(0, 1)[slots].clone(), v.flatten(0, 1)[slots].clone())
                      for k, v in zip(pg.k_caches, pg.v_caches)]
            for k, v in zip(pg.k_caches, pg.v_caches):  # the graph must write the chunk's K/V itself
                k.flatten(0, 1)[slots] = 0
                v.flatten(0, 1)[slots] = 0
            logits, hidden = pg.run(ids[CONTEXT:], CONTEXT, table)
            ok_l, r["logit_diff"] = _within(logits, ref_logits, dtype)
            ok_h, r["hidden_diff"] = _within(hidden, ref_hidden, dtype)
            r["kv_ok"] = all(_within(k.flatten(0, 1)[slots], rk, dtype)[0] and _within(v.flatten(0, 1)[slots], rv, dtype)[0]
                             for (k, v), (rk, rv) in zip(zip(pg.k_caches, pg.v_caches), ref_kv))
            r["ok"] = ok_l and ok_h and r["kv_ok"]
        except Exception as e:  # a replay that fails is a bucket that cannot serve
            r["error"] = f"{type(e).__name__}: {e}"
        finally:
            for (k, v), (k0, v0) in zip(zip(pg.k_caches, pg.v_caches), saved):
                k[table], v[table] = k0, v0
        report[S] = r
    pg.num_runs = 0  # the warm-up chunks served no request
    bad = [S for S, r in report.items() if not r["ok"]]
    if bad:
        pg.drop(bad)
        log.warning("prefill graphs: bucket(s) %s differ from the eager prefill and are dropped (eager or a larger "
                    "bucket serves those chunks): %s", bad, {S: report[S] for S in bad})
    pg.check = report
    return report


def summary(report: dict | None) -> str:
    """One line per ModelRunner.prefill_graph_report: the buckets kept, and per bucket checked its diffs or error."""
    if not report:
        return "prefill graphs: not enabled"
    parts = []
    for S, r in sorted(report["check"].items()):
        if r.get("error"):
            parts.append(f"{S}: FAIL {r['error'][:120]}")
        else:
            parts.append(f"{S}: {'ok' if r['ok'] else 'FAIL'} logits {r['logit_diff']:.2e} hidden {r['hidden_diff']:.2e}"
                         f" kv {'ok' if r['kv_ok'] else 'DIFF'}")
    for S, e in sorted(report["capture_errors"].items()):
        parts.append(f"{S}: capture FAILED {e[:120]}")
    return f"prefill graphs kept {report['kept']} (self-check vs eager: {'; '.join(parts) or 'none'})"
