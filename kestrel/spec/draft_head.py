"""Semi-autoregressive draft head on the target's hidden states (DSpark-style).

Input: the target's final hidden state h_t (the vector its lm_head turns into logits for token t+1) and the token
x_{t+1} just emitted. A parallel backbone maps (h_t, x_{t+1}) to k slot states at once, one per future position
t+2 .. t+k+1; a light sequential refiner then corrects slot i >= 1 with the embedding of the token chosen at slot
i-1 (low-rank, so k steps cost little). With `recurrent` (the default for new heads) the refiner also reads the
previous slot's refined state, so slot i sees the whole drafted chain x_{t+2} .. x_{t+i}, not just the last token
(without it slot 3 never learns what was drafted at slot 1). Each slot reads out through the target's own (frozen) lm_head and also
predicts its acceptance probability (the confidence the scheduler uses). The head stores only its own weights; the
embedding and lm_head matrices come from the target at run time.

With `context=W` (session 11, offline only so far) the fused input state also attends over the target's last W
hidden states h_{t-W+1} .. h_t (one small attention head, its output projection zero-initialised: a head grown
from a context-free one starts out drafting exactly as before). Why: the context-free head sees only h_t, a state
shaped to predict x_{t+1}, and must guess x_{t+2} from it and x_{t+1}'s embedding alone (slot 1 ~49% accepted);
EAGLE-style drafters read a window of past features.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


_EPS = torch.finfo(torch.float32).eps  # nn.RMSNorm(eps=None) in float32 training


def _rms(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The head's RMSNorm, with the float32 training eps pinned whatever the dtype. Without autograd on CUDA (drafting):
    kestrel's one-pass Triton row kernel (PyTorch's generic norm kernel ~6 us per call; a draft runs 3 + k)."""
    eps = norm.eps if norm.eps is not None else _EPS
    if x.is_cuda and not torch.is_grad_enabled() and os.environ.get("KESTREL_HEAD_TRITON_NORM", "1") != "0":
        from kestrel.kernels.rmsnorm import rms_norm
        return rms_norm(x, norm.weight, eps)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, eps)


def _repeat_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x.repeat_interleave(n, 0) through a view: no host sync, so a draft tree can be captured in a CUDA graph."""
    return x[:, None].expand(x.shape[0], n, *x.shape[1:]).reshape(x.shape[0] * n, *x.shape[1:])


class _MLPBlock(nn.Module):
    def __init__(self, H: int, mult: int):
        super().__init__()
        self.norm = nn.RMSNorm(H)
        self.up = nn.Linear(H, mult * H)
        self.down = nn.Linear(mult * H, H)

    def forward(self, x):
        return x + self.down(F.silu(self.up(_rms(self.norm, x))))


class DraftHead(nn.Module):
    def __init__(self, hidden_size: int, k: int = 4, layers: int = 2, mult: int = 2, refine_rank: int = 128,
                 recurrent: bool = False, context: int = 0, context_dim: int = 128):
        super().__init__()
        H = hidden_size
        self.cfg = dict(hidden_size=H, k=k, layers=layers, mult=mult, refine_rank=refine_rank, recurrent=recurrent)
        if context:  # only then in the metadata: context-free heads keep their old files and cfg
            self.cfg.update(context=context, context_dim=context_dim)
        self.k, self.recurrent, self.context = k, recurrent, context
        self.in_norm = nn.RMSNorm(2 * H)
        self.fuse = nn.Linear(2 * H, H)
        self.slot = nn.Parameter(torch.randn(k, H) * 0.02)
        self.backbone = nn.ModuleList(_MLPBlock(H, mult) for _ in range(layers))
        self.refine_in = nn.Linear((3 if recurrent else 2) * H, refine_rank)
        self.refine_out = nn.Linear(refine_rank, H)
        self.out_norm = nn.RMSNorm(H)
        self.conf = nn.Linear(H, 1)
        if context:
            self.ctx_norm = nn.RMSNorm(H)
            self.ctx_q = nn.Linear(H, context_dim)
            self.ctx_kv = nn.Linear(H, 2 * context_dim, bias=False)
            self.ctx_o = nn.Linear(context_dim, H)
            nn.init.zeros_(self.ctx_o.weight)
            nn.init.zeros_(self.ctx_o.bias)
        self.vocab = None  # optional LongTensor: the tokens greedy drafting may propose (subset_readout)

    @staticmethod
    def context_window(hidden: torch.Tensor, t: torch.Tensor, W: int, first: int = 0):
        """The last W hidden states up to position t of one sequence: ([N, W, H], valid [N, W]). hidden[i] is
        position first + i; positions before `first` (not collected) are masked out."""
        pos = t[:, None] - torch.arange(W - 1, -1, -1, device=t.device)[None, :]
        valid = pos >= first
        return hidden[(pos - first).clamp(min=0)], valid

    def attend(self, z0: torch.Tensor, ctx: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """One attention head from the fused state z0 [N, H] over context states ctx [N, W, H] -> [N, H]."""
        d = self.ctx_q.out_features
        q = self.ctx_q(z0)
        k, v = self.ctx_kv(_rms(self.ctx_norm, ctx.to(z0.dtype))).split(d, -1)
        att = (k @ q[:, :, None]).squeeze(-1) * d ** -0.5
        if valid is not None:
            att = att.masked_fill(~valid, float("-inf"))
        return self.ctx_o((torch.softmax(att.float(), -1).to(v.dtype)[:, :, None] * v).sum(1))

    def slots(self, h: torch.Tensor, e_next: torch.Tensor, ctx: torch.Tensor | None = None,
              ctx_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Parallel backbone: [N, H], [N, H] -> [N, k, H]. ctx / ctx_valid: context_window()'s output (context
        heads; None: drafted without context, as a context-free head)."""
        z0 = self.fuse(_rms(self.in_norm, torch.cat([h, e_next], -1)))
        if self.context and ctx is not None:
            z0 = z0 + self.attend(z0, ctx, ctx_valid)
        z = z0[:, None, :] + self.slot[None]
        for blk in self.backbone:
            z = blk(z)
        return z

    def refine(self, z: torch.Tensor, e_prev: torch.Tensor, s_prev: torch.Tensor | None = None) -> torch.Tensor:
        """Slot state z corrected by the token drafted just before it (and, recurrent, the previous refined state)."""
        x = torch.cat([z, e_prev] if not self.recurrent else [z, e_prev, s_prev], -1)
        return z + self.refine_out(F.silu(self.refine_in(x)))

    def chain(self, z: torch.Tensor, e_prev_slots: torch.Tensor) -> torch.Tensor:
        """Refined states [N, k, H] of all slots given the tokens before each slot (teacher forcing)."""
        if not self.recurrent:  # each slot only reads its own previous token: all slots at once
            return torch.cat([z[:, :1], self.refine(z[:, 1:], e_prev_slots[:, 1:])], 1)
        out = [z[:, 0]]
        for i in range(1, z.shape[1]):
            out.append(self.refine(z[:, i], e_prev_slots[:, i], out[-1]))
        return torch.stack(out, 1)

    def readout(self, z: torch.Tensor, lm_head: torch.Tensor):
        """Slot states -> (logits over the target vocab, confidence logit)."""
        return _rms(self.out_norm, z) @ lm_head.t(), self.conf(z).squeeze(-1)

    def forward_teacher(self, h, e_next, e_prev_slots, lm_head, ctx=None, ctx_valid=None):
        """Training: slot i >= 1 is refined with the true previous token (teacher forcing), all in parallel.
        e_prev_slots: [N, k, H] embedding of the token before each slot's target. Returns logits [N, k, V],
        confidence logits [N, k]."""
        return self.readout(self.chain(self.slots(h, e_next, ctx, ctx_valid), e_prev_slots), lm_head)

    def subset_readout(self, embed: torch.Tensor, lm_head: torch.Tensor):
        """(token ids [N], their embeddings [N, H], lm_head rows times out_norm's weight [N, H]) for draft_greedy's
        readout over the head's draft vocabulary, or None without one. Why: each slot's readout over the target's
        full vocabulary reads the whole lm_head (49k x 576 bf16 = 57 MB, ~17 us on an H200: a third of a k=4
        proposal, session 4 R1); the most frequent 8k tokens of the training text cover almost all of it, and
        argmax(rmsnorm(z) @ L^T) = argmax((z * w) @ L^T) (the 1/rms factor is positive), so the norm goes too.
        Lossless: a token outside the subset is only never proposed (verification decides)."""
        if self.vocab is None:
            return None
        sub = self.vocab.to(embed.device)
        w = self.out_norm.weight.detach().float().to(embed.device)
        return sub, embed[sub].contiguous(), (lm_head[sub].float() * w).to(lm_head.dtype).contiguous()

    @torch.no_grad()
    def draft_greedy(self, h, x_next, embed, lm_head, k, want_conf: bool = True, readout=None, ctx=None,
                     ctx_valid=None):
        """draft() for all-greedy rows with no host syncs (capturable in a CUDA graph): tokens [N, k] (argmax),
        confidence [N, k] float32 (None without want_conf: the device loop does not read it, and each slot's
        confidence is 3 more launches in its graph). readout: subset_readout()'s tensors (argmax over the draft
        vocabulary only), or a callable taking (head, h, x_next, embed, k, want_conf) that drafts instead (the
        fused kernels of head_fused.FusedGreedyDraft)."""
        if callable(readout):
            if self.context:
                raise ValueError("fused drafting has no context attention (context heads: PyTorch path only)")
            return readout(self, h, x_next, embed, k, want_conf)
        z = self.slots(h, embed[x_next], ctx, ctx_valid)
        toks, confs, prev, zi = [], [], x_next, None
        if readout is not None:
            sub, emb_s, lm_s = readout
            e = None
        for i in range(min(k, self.k)):
            if readout is None:
                zi = z[:, i] if i == 0 else self.refine(z[:, i], embed[prev], zi)
                prev = (_rms(self.out_norm, zi) @ lm_head.t()).argmax(-1)
                toks.append(prev)
            else:
                zi = z[:, i] if i == 0 else self.refine(z[:, i], e, zi)
                j = (zi @ lm_s.t()).argmax(-1)
                e = emb_s[j]
                toks.append(j)
            if want_conf:
                confs.append(torch.sigmoid(self.conf(zi).squeeze(-1).float()))
        toks = torch.stack(toks, 1)
        if readout is not None:
            toks = sub[toks]
        return toks, torch.stack(confs, 1) if want_conf else None

    @torch.no_grad()
    def draft_tree(self, h, x_next, embed, lm_head, widths, readout=None, nodes: bool = False, z=None, ctx=None,
                   ctx_valid=None):
        """Greedy draft tree, for measuring what tree verification could accept (bench/draft_acceptance.py): slot i
        keeps the widths[i] most likely tokens under every branch of slot i-1, each branch refined with its own
        chain. Returns tokens [N, P, len(widths)], one row per root-to-leaf path (P = prod(widths)); widths of all
        ones is draft_greedy's chain. readout: subset_readout()'s tensors or None (full vocabulary). nodes: return
        the tree's nodes instead, [N, n] level by level (kestrel/spec/tree.py's TreeShape order: node c of level i is
        child c % widths[i] of node c // widths[i] of level i-1), for tree verification in the device loop. z: the
        backbone's slot states if already computed (the loop's fused backbone, head_gemm.fused_slots)."""
        z = self.slots(h, embed[x_next], ctx, ctx_valid) if z is None else z
        N = z.shape[0]
        if readout is not None:
            sub, emb_s, lm_s = readout
        paths, zi, e, P, levels = None, None, None, 1, []
        for i, w in enumerate(widths[:self.k]):
            zi = z[:, 0] if i == 0 else self.refine(_repeat_rows(z[:, i], P), e, zi)
            logits = zi @ lm_s.t() if readout is not None else _rms(self.out_norm, zi) @ lm_head.t()
            top = logits.float().topk(w, -1).indices  # [N * P, w]: parent p's children at p * w + c
            zi = _repeat_rows(zi, w)
            e = (emb_s if readout is not None else embed)[top.reshape(-1)]
            col = top.view(N, P * w, 1)
            P *= w
            if nodes:
                levels.append(top.view(N, P))
                continue
            paths = col if paths is None else torch.cat([paths.repeat_interleave(w, 1), col], -1)
        if nodes:
            out = torch.cat(levels, 1)
            return sub[out] if readout is not None else out
        return sub[paths] if readout is not None else paths

    @torch.no_grad()
    def draft(self, h, x_next, embed, lm_head, k, temperature=None, generator=None):
        """Inference: propose k tokens per row. temperature [N] (0 = greedy). Returns tokens [N, k],
        confidence [N, k], q [N, k, V] (the distributions sampled from; T=1 softmax for greedy rows) or None when
        every row is greedy."""
        k = min(k, self.k)
        N = h.shape[0]
        z = self.slots(h, embed[x_next])
        temp = torch.zeros(N, device=h.device) if temperature is None else temperature.to(h.device).float()
        sample = temp > 0
        any_sample = bool(sample.any())
        toks, confs, qs = [], [], []
        prev, zi = x_next, None
        for i in range(k):
            zi = z[:, i] if i == 0 else self.refine(z[:, i], embed[prev], zi)
            logits, c = self.readout(zi, lm_head)
            logits = logits.float()
            tok = logits.argmax(-1)
            if any_sample:  # q only matters for sampled rows (greedy verification needs no draft distribution)
                q = torch.softmax(logits / torch.where(sample, temp, torch.ones_like(temp))[:, None], -1)
                tok[sample] = torch.multinomial(q[sample], 1, generator=generator).squeeze(1)
                qs.append(q)
            toks.append(tok)
            confs.append(torch.sigmoid(c.float()))
            prev = tok
        return torch.stack(toks, 1), torch.stack(confs, 1), torch.stack(qs, 1) if qs else None

    def grown(self, context: int, context_dim: int = 128) -> "DraftHead":
        """This head plus a context attention over the last `context` hidden states, drafting exactly as this one
        until trained (the attention's output projection starts at zero)."""
        cfg = {k: v for k, v in self.cfg.items() if k not in ("context", "context_dim")}
        new = DraftHead(**cfg, context=context, context_dim=context_dim).to(self.slot.device, self.slot.dtype)
        missing, unexpected = new.load_state_dict(self.state_dict(), strict=False)
        assert not unexpected and all(m.startswith("ctx_") for m in missing), (missing, unexpected)
        new.vocab = self.vocab
        return new

    # --- persistence: safetensors with the architecture in the metadata ---
    def save(self, path: str, extra: dict | None = None, dtype: torch.dtype | None = None) -> None:
        """dtype: store the weights in e.g. bfloat16 (half the file; the head runs in the target's dtype anyway)."""
        from safetensors.torch import save_file
        meta = {"kestrel_draft_head": json.dumps(self.cfg), **{k: str(v) for k, v in (extra or {}).items()}}
        t = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        if self.vocab is not None:
            t["draft_vocab"] = self.vocab.detach().long().contiguous().cpu()
        save_file(t, path, metadata=meta)

    @classmethod
    def load(cls, path: str, device="cpu") -> "DraftHead":
        from safetensors import safe_open
        from safetensors.torch import load_file
        try:
            with safe_open(path, "pt") as f:
                meta = f.metadata() or {}
        except Exception as e:  # missing file, not safetensors, truncated
            raise ValueError(f"cannot read draft head {path!r}: {e}") from None
        if "kestrel_draft_head" not in meta:
            raise ValueError(f"{path} is not a kestrel draft head (train one with `kestrel train-draft`)")
        head = cls(**json.loads(meta["kestrel_draft_head"]))
        sd = load_file(path, device="cpu")
        vocab = sd.pop("draft_vocab", None)
        head.load_state_dict({k: v.float() for k, v in sd.items()})
        head.vocab = vocab
        head.meta = meta
        return head.to(device).eval()
