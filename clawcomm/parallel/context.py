"""Context parallelism: each rank of a cp group holds 1/cp of every
sequence, and causal attention runs over the whole sequence by passing
key/value blocks around the group.

**Which tokens** (``positions``): the sequence is cut into 2 cp chunks and
rank c holds chunks c and 2cp - 1 - c, so that under the causal mask every
rank does the same work (a rank holding only the first chunk would attend
to almost nothing, the last to everything). Everything outside attention
is per token and runs on the rank's tokens alone.

**Ring attention** (``ring_attention``, the default, ``--cp-method ring``):
the rank's keys and values go around the ring (rank c sends to c + 1 and
hears from c - 1); at step s a rank holds rank (c - s)'s block and
computes its queries against it while the next block is in flight, then
merges the block's result into its own with the online-softmax rule (each
row's running log-sum-exp). A pair of chunks is skipped where the key
chunk lies after the query chunk, masked causally where they are the same.
Backward passes the blocks around the same ring again, and behind each
block the gradients of its keys and values, accumulated by the ranks it
visited: a rank computes its share of the held block's dK and dV, adds
what the ranks before it sent, passes the sum on, and computes its dQ terms
and the next block while the sum travels; a last hop takes each block's
gradients home. Nothing of size sequence x sequence
is kept: each pair's scores are made again in backward from the queries,
keys and the saved log-sum-exp (as flash attention's backward does).

**All-gather** (``--cp-method allgather``): every rank gathers every
rank's keys and values, attends with the matching mask, and backward
reduce-scatters their gradients; for comparison.

Every blocking wait on a transfer is timed into ``EXPOSED`` (the trainer's
``cp_ms``; it includes waiting for a peer that is still computing), and the
attention's own arithmetic into ``COMPUTE``, as the calling thread's CPU
seconds (what the balance figure compares across ranks: CPU time, unlike
wall time, does not count the time the rank's thread waited for a core on a
machine with more ranks than cores; with several intra-op threads it counts
the calling thread's share only).
"""

from __future__ import annotations

import functools
import math
import time

import torch
import torch.distributed as dist

from clawcomm._torch_names import all_gather_single, reduce_scatter_single
from clawcomm.parallel.tensor.comm import Exposed

EXPOSED = Exposed()  # blocked on the cp group's transfers
COMPUTE = Exposed()  # the attention's arithmetic (for the balance figure)


class Landed:
    """Of the ring's transfers a rank waited for, how many had landed
    (sent and received) before it needed them: hidden entirely behind its
    computation."""

    def __init__(self):
        self.landed = self.waited = 0

    def count(self, landed: bool) -> None:
        self.landed += int(landed)
        self.waited += 1

    def lap(self) -> tuple[int, int]:
        out = (self.landed, self.waited)
        self.landed = self.waited = 0
        return out


LANDED = Landed()
KV, GRADS = 7001, 7002  # the tags of the two streams between neighbours


def chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) that ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions of the tokens ``rank`` holds, in the order it holds them."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism: seq_len {seq_len} is not a multiple of 2 cp")
    n = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * n, (i + 1) * n) for i in chunks(rank, cp)])


def take(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """``rank``'s tokens of ``x`` (whole sequences along ``dim``)."""
    n = x.shape[dim] // (2 * cp)
    return torch.cat([x.narrow(dim, i * n, n) for i in chunks(rank, cp)], dim)


def _pairs(q_chunks, k_chunks):
    """(query half, key half, causal?) for each pair that attends: a key
    chunk before the query chunk, whole; the same chunk, causally."""
    for a, qc in enumerate(q_chunks):
        for b, kc in enumerate(k_chunks):
            if kc < qc:
                yield a, b, False
            elif kc == qc:
                yield a, b, True


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _wide(dtype: torch.dtype) -> torch.dtype:
    """What the softmax statistics and sums are kept in (float32 at least)."""
    return torch.promote_types(dtype, torch.float32)


def _halves(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.chunk(2, dim=-2))


class _Ring:
    """The ring's neighbours in ``group``, and one step's exchange."""

    def __init__(self, group):
        self.group = group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.n)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.n)

    def start(self, t: torch.Tensor, tag: int):
        """Sends ``t`` on and posts the receive of the neighbour's; returns
        (the buffer, the requests)."""
        buf = torch.empty_like(t)
        recv = dist.irecv(buf, self.prev, group=self.group, tag=tag)
        send = dist.isend(t, self.next, group=self.group, tag=tag)
        return buf, (recv, send)

    @staticmethod
    def wait(requests) -> None:
        LANDED.count(all(r.is_completed() for r in requests))
        t0 = time.perf_counter()
        for r in requests:
            r.wait()
        EXPOSED.seconds += time.perf_counter() - t0


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group):
        ring = _Ring(group)
        c, cp = ring.rank, ring.n
        scale = 1.0 / math.sqrt(q.shape[-1])
        qs, wide = _halves(q), _wide(q.dtype)
        out = [torch.zeros_like(h, dtype=wide) for h in qs]
        lse = [torch.full(h.shape[:-1], float("-inf"), dtype=wide, device=q.device) for h in qs]
        kv = torch.stack([k, v]).contiguous()
        for s in range(cp):
            pending = ring.start(kv, KV) if s < cp - 1 else None
            t0 = time.thread_time()
            ks, vs = _halves(kv[0]), _halves(kv[1])
            for a, b, causal in _pairs(chunks(c, cp), chunks((c - s) % cp, cp)):
                sc = _scores(qs[a], ks[b], causal, scale).to(wide)
                block = torch.logsumexp(sc, -1)
                o = torch.matmul(torch.exp(sc - block.unsqueeze(-1)).to(vs[b].dtype), vs[b])
                new = torch.logaddexp(lse[a], block)
                out[a] = out[a] * torch.exp(lse[a] - new).unsqueeze(-1) + o.to(wide) * torch.exp(
                    block - new
                ).unsqueeze(-1)
                lse[a] = new
            COMPUTE.seconds += time.thread_time() - t0
            if pending is not None:
                kv, requests = pending
                ring.wait(requests)
        out = torch.cat(out, -2).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, torch.cat(lse, -1))
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        c, cp = ring.rank, ring.n
        scale = 1.0 / math.sqrt(q.shape[-1])
        grad, wide = grad.contiguous(), _wide(q.dtype)
        qs, gs, lses = _halves(q.to(wide)), _halves(grad.to(wide)), list(lse.chunk(2, dim=-1))
        delta = _halves((grad.to(wide) * out.to(wide)).sum(-1, keepdim=True))
        dq = [torch.zeros_like(h) for h in qs]
        kv = torch.stack([k, v]).contiguous()
        passing = None  # the accumulated dK, dV of the block held next, in flight
        for s in range(cp):
            pending = ring.start(kv, KV) if s < cp - 1 else None
            t0 = time.thread_time()
            ks, vs = _halves(kv[0].to(wide)), _halves(kv[1].to(wide))
            mine = torch.zeros_like(kv, dtype=wide)  # this rank's share of the block's dK, dV
            dks, dvs = _halves(mine[0]), _halves(mine[1])
            later = []  # (query half, ds, key half): the dQ terms, computed behind the send
            for a, b, causal in _pairs(chunks(c, cp), chunks((c - s) % cp, cp)):
                p = torch.exp(_scores(qs[a], ks[b], causal, scale) - lses[a].unsqueeze(-1))
                dvs[b] += torch.matmul(p.transpose(-1, -2), gs[a])
                ds = p * (torch.matmul(gs[a], vs[b].transpose(-1, -2)) - delta[a]) * scale
                dks[b] += torch.matmul(ds.transpose(-1, -2), qs[a])
                later.append((a, ds, b))
            COMPUTE.seconds += time.thread_time() - t0
            if passing is not None:  # what the ranks before added to this block
                acc, requests = passing
                ring.wait(requests)
                mine += acc
            # On with the block's gradients (after the last step, home), while
            # this rank computes its dQ terms and the next step.
            passing = ring.start(mine, GRADS)
            t0 = time.thread_time()
            for a, ds, b in later:
                dq[a] += torch.matmul(ds, ks[b])
            COMPUTE.seconds += time.thread_time() - t0
            if pending is not None:
                kv, requests = pending
                ring.wait(requests)
        acc, requests = passing
        ring.wait(requests)
        dk, dv = acc[0].to(k.dtype), acc[1].to(v.dtype)
        return torch.cat(dq, -2).to(q.dtype), dk, dv, None


def ring_attention(q, k, v, group) -> torch.Tensor:
    """Causal attention of this rank's queries ``q`` over the whole
    sequence's keys and values, [b, heads, 2 chunks, d] each, held as
    ``chunks`` says over the cp ``group`` (the module docstring)."""
    return _RingAttention.apply(q, k, v, group)


class _GatherKV(torch.autograd.Function):
    """Every rank's [b, h, t, d] along a new leading dim; backward sums each
    rank's gradient to it (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty((n, *x.shape))
        t0 = time.perf_counter()
        all_gather_single(out.view(-1, *x.shape[1:]), x.contiguous(), group=group)
        EXPOSED.seconds += time.perf_counter() - t0
        return out

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty(g.shape[1:])
        t0 = time.perf_counter()
        reduce_scatter_single(out, g.contiguous().view(-1, *g.shape[2:]), group=ctx.group)
        EXPOSED.seconds += time.perf_counter() - t0
        return out, None


def allgather_attention(q, k, v, group) -> torch.Tensor:
    """``ring_attention``'s result with every rank's keys and values
    gathered first (``--cp-method allgather``)."""
    c, cp = dist.get_rank(group), dist.get_world_size(group)
    ks, vs = _GatherKV.apply(k, group), _GatherKV.apply(v, group)
    n = q.shape[-2] // 2
    # Each gathered rank's two chunks, laid out in sequence order.
    order = sorted((chunk, r, h) for r in range(cp) for h, chunk in enumerate(chunks(r, cp)))
    keys = torch.cat([_halves(ks[r])[h] for _, r, h in order], -2)
    values = torch.cat([_halves(vs[r])[h] for _, r, h in order], -2)
    pos = positions(2 * cp * n, cp, c).to(q.device)
    mask = pos.unsqueeze(1) >= torch.arange(2 * cp * n, device=q.device).unsqueeze(0)
    t0 = time.thread_time()
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    COMPUTE.seconds += time.thread_time() - t0
    return out


# ---- the trainer's models, split -----------------------------------------------------


def split(modules, group, cfg) -> None:
    """Makes the GPT of ``modules`` (the whole model, or its stages) run on
    this rank's tokens of each sequence: its embedding adds their
    positions (``token_positions``), its blocks attend over the cp
    ``group`` (``attention_across``) by ``cfg.cp_method``."""
    rank = dist.get_rank(group)
    attend = ring_attention if cfg.cp_method == "ring" else allgather_attention
    held = positions(cfg.seq_len, cfg.cp, rank)
    for mod in modules:
        for m in mod.modules():
            if hasattr(m, "token_positions"):
                m.token_positions = held
            if hasattr(m, "attention_across"):
                m.attention_across = functools.partial(attend, group=group)


def kv_bytes(model, seq_len: int) -> list[float]:
    """Per layer of the whole (unsplit) model, the bytes of one sample's
    keys and values (float32) where it attends: what the planner prices
    the ring's hops by (a rank's block is 1/cp of them, 1/tp at tp)."""
    out = []
    for layer in model:
        attends = hasattr(layer, "attention_across")
        out.append(2.0 * 4 * seq_len * layer.qkv.in_features if attends else 0.0)
    return out


def check(cfg) -> None:
    """The context-parallel settings suit the model and the other flags
    (ValueError naming the first that does not)."""
    if cfg.cp == 1:
        return
    if cfg.model != "gpt":
        raise ValueError(
            f"cp {cfg.cp} splits each sequence over ranks: it needs --model gpt, not {cfg.model}"
        )
    if cfg.seq_len % (2 * cfg.cp):
        raise ValueError(
            f"cp {cfg.cp} cuts each sequence into 2 x cp = {2 * cfg.cp} chunks: seq_len "
            f"{cfg.seq_len} is not a multiple of {2 * cfg.cp}"
        )
    for name, bad, why in (
        ("compression", bool(cfg.compression), "compressed gradients"),
        ("sync", cfg.sync != "every-step", "replicas that meet every H steps"),
    ):
        if bad:
            raise ValueError(
                f"cp {cfg.cp} with {name} {getattr(cfg, name)!r} is not supported yet ({why}): "
                "use cp 1 for it"
            )
