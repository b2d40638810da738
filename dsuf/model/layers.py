"""Building blocks shared by the DeepSeek model families, written for the reference path.

Weights are held dequantised (FP8/FP4 values times power-of-two scales are exact in any float
format), so one loaded model can run either numerics mode:

- `exact`: no activation quantisation and no KV fake-quants; activations in the chosen dtype.
- `reference`: DeepSeek's numerics — per-block FP8 activation quantisation before FP8/FP4 linears
  (W8A8/W4A8 with fp32 accumulation and bf16 output), fake-quantised caches, bf16 between modules.

Batch invariance: every reduction (matmuls, norms, softmax sums) accumulates in float64, and
every transcendental function (exp, sigmoid, silu, softplus, cos, sin) is evaluated in float64 —
CPU kernels compute the vectorised body and the scalar tail of a tensor differently — then the
result is rounded to float32 where the reference holds an fp32 value. A row's result then does
not depend on which other rows share the call, so prefill, chunked prefill, decode and any mix
of sequences in one batch give the same numbers, and FP8 rounding cannot amplify
accumulation-order noise into different outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from . import quant
from .quant import PackedRows

if TYPE_CHECKING:
    from .config import ModelConfig
    from .state import CompressorState, LayerState, SequenceState

NumericsMode = Literal["exact", "reference"]
ACC = torch.float64  # accumulation dtype of the reference path (see the module docstring)


def acc_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ wᵀ accumulated in float64 (w already float64), rounded to float32."""
    return F.linear(x.to(ACC), w).float()


def f64(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) evaluated in float64, rounded to float32 (see the module docstring)."""
    return fn(x.to(ACC)).float()


@dataclass(frozen=True)
class Numerics:
    mode: NumericsMode = "reference"
    dtype: torch.dtype = torch.bfloat16  # activations between modules

    @property
    def quantize(self) -> bool:
        return self.mode == "reference"

    @staticmethod
    def parse(mode: str, dtype: str | None = None) -> "Numerics":
        if mode not in ("exact", "reference"):
            raise ValueError(f"numerics must be 'exact' or 'reference', got {mode!r}")
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        if dtype is None:
            dtype = "bfloat16" if mode == "reference" else "float32"
        if dtype not in dtypes:
            raise ValueError(f"dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
        return Numerics(mode, dtypes[dtype])  # type: ignore[arg-type]


class Linear:
    """y = x Wᵀ (fp32 result, rounded to the output dtype); in reference mode the input is
    FP8-quantised per block first when the checkpoint stores W in FP8/FP4 (`act_block` set), as
    DeepSeek's kernels do."""

    def __init__(self, weight: torch.Tensor, act_block: int | None = None) -> None:
        self.weight = weight.to(ACC)
        self.act_block = act_block

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor, num: Numerics, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if num.quantize and self.act_block:
            x = quant.act_quant_fp8(x, self.act_block)
        return acc_matmul(x, self.weight).to(out_dtype or num.dtype)


class Weights:
    """Float32 views of a checkpoint's tensors: FP8/FP4 weights dequantised with their scales."""

    def __init__(self, tensors: dict[str, torch.Tensor], c: ModelConfig) -> None:
        self.tensors = tensors
        self.config = c

    def raw(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def float(self, name: str) -> torch.Tensor:
        return self.tensors[name].float()

    def linear(self, name: str) -> Linear:
        """A linear layer; FP8/FP4 storage means its input is act-quantised in reference mode."""
        w = self.tensors[f"{name}.weight"]
        scale = self.tensors.get(f"{name}.scale")
        q = self.config.quant
        if scale is None:
            return Linear(w)
        if w.dtype == torch.int8:
            return Linear(quant.dequant_fp4_weight(w, scale, q.fp4_block), act_block=q.weight_block)
        return Linear(quant.dequant_fp8_weight(w, scale, q.weight_block), act_block=q.weight_block)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32, weight applied in float32, result in x's dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.to(ACC).square().mean(-1, keepdim=True) + eps).float()
    if weight is not None:
        x = weight * x
    return x.to(dtype)


# ---- rotary embeddings ---------------------------------------------------------------------------


class Rope:
    """GPT-J style (interleaved pairs) rotary embedding on the trailing `dim` channels, with
    optional YaRN frequency blending. Angles are pos · f computed in float32, as in the reference."""

    def __init__(self, dim: int, base: float, yarn: tuple[float, int, float, float] | None = None) -> None:
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        if yarn is not None:
            factor, original_len, beta_fast, beta_slow = yarn

            def correction_dim(rotations: float) -> float:
                return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

            low = max(math.floor(correction_dim(beta_fast)), 0)
            high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
            if low == high:
                high += 0.001
            ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
            freqs = freqs / factor * ramp + freqs * (1 - ramp)
        self.dim = dim
        self.freqs = freqs

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = torch.outer(positions.to(torch.float32), self.freqs).to(ACC)  # float32 angles, cos and sin in float64
        return torch.cos(angles).float(), torch.sin(angles).float()

    def apply(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], inverse: bool = False) -> torch.Tensor:
        """Rotate x[..., -dim:]; x is [T, ..., C] and cos/sin are [T, dim/2]."""
        cos, sin = cos_sin
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.view(shape), sin.view(shape)
        if inverse:
            sin = -sin
        rope = x[..., -self.dim :].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
        return torch.cat((x[..., : -self.dim], rotated.to(x.dtype)), dim=-1)


# ---- manifold-constrained hyper-connections (mHC) -----------------------------------------------


@dataclass
class HyperConnection:
    """One mHC site: `fn` [(2+n)·n, n·D] (held in float64 for the accumulation), `base`
    [(2+n)·n] and `scale` [3] in float32."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        self.fn = self.fn.to(ACC)  # once at load, not on every step

    def mixes(self, x: torch.Tensor, norm_eps: float) -> torch.Tensor:
        """x [T, n, D] → [T, (2+n)·n]: one RMS statistic over all n·D values, matmul first."""
        flat = x.flatten(1).to(ACC)
        rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
        return F.linear(flat, self.fn).float() * rsqrt.float()

    def coefficients(
        self, x: torch.Tensor, norm_eps: float, hc_eps: float, iters: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """pre [T, n], post [T, n] and the doubly-stochastic comb [T, n, n] (Sinkhorn, fp32)."""
        n = x.shape[1]
        mix = self.mixes(x, norm_eps)
        pre = f64(torch.sigmoid, mix[:, :n] * self.scale[0] + self.base[:n]) + hc_eps
        post = 2 * f64(torch.sigmoid, mix[:, n : 2 * n] * self.scale[1] + self.base[n : 2 * n])
        logits = (mix[:, 2 * n :] * self.scale[2] + self.base[2 * n :]).view(-1, n, n)
        comb = torch.softmax(logits.to(ACC), dim=-1) + hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
        return pre, post, comb.float()


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """y = Σ_i pre_i · X_i in float32, cast to the stream dtype."""
    return (pre.unsqueeze(-1).to(ACC) * x.to(ACC)).sum(dim=1).float().to(x.dtype)


def hc_expand(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k · out + Σ_j comb[j, k] · X_j, in float32 and rounded once."""
    mixed = torch.einsum("tjk,tjd->tkd", comb.to(ACC), residual.to(ACC))
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed.float()).to(residual.dtype)


# ---- attention ------------------------------------------------------------------------------------


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float, num: Numerics
) -> torch.Tensor:
    """Single-KV-head attention with per-head sinks: q [T, H, d], keys (= values) [L, d],
    mask [T, L] (True = attend). The sink adds exp(sink − max) to the denominator only; in
    reference mode probabilities are rounded to the activation dtype before PV, as the kernel does."""
    k = keys.to(ACC)
    scores = torch.einsum("thd,ld->thl", q.to(ACC), k).float() * scale
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    probs = f64(torch.exp, scores - peak)
    denom = probs.to(ACC).sum(dim=-1).float() + f64(torch.exp, sink.unsqueeze(0) - peak.squeeze(-1))
    if num.quantize:
        probs = probs.to(num.dtype)
    out = torch.einsum("thl,ld->thd", probs.to(ACC), k).float() / denom.unsqueeze(-1)
    return out.to(num.dtype)


@dataclass
class Segment:
    """The rows of one sequence inside a batched call, and that sequence's state for one layer."""

    rows: slice
    start: int  # position of the first row
    layer_state: LayerState

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.rows.stop - self.rows.start)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row (the indexer's selection); equal scores go to the
    lower index, so the choice never depends on the batch a row is computed in."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]


def store_rows(rows: torch.Tensor, fmt: PackedRows | None, num: Numerics) -> torch.Tensor:
    """What a cache keeps of new rows: in reference numerics, the bytes of its packed format (which
    quantises them) where it has one; otherwise the rows themselves."""
    return fmt.pack(rows) if fmt is not None and num.quantize else rows


def load_rows(stored: torch.Tensor, fmt: PackedRows | None, num: Numerics) -> torch.Tensor:
    """The values of cached rows in the activation dtype (inverse of `store_rows`)."""
    return fmt.unpack(stored).to(num.dtype) if fmt is not None and num.quantize else stored


class Compressor:
    """Gated pooling of `ratio` tokens into one KV entry (float32 throughout, like the reference):
    entry j is the per-channel softmax(score)-weighted sum of its group's kv, then RMSNorm. The
    result is the pre-RoPE latent; entry j stands for position ratio·j, its group's first token.

    Ratio 4 (V4's CSA) overlaps windows: entry j pools 8 slots, the previous group's tokens on
    channels [0, width) and its own group's tokens on channels [width, 2·width). V4 adds a learned
    `ape` per slot to the score; V4.1 has none. Ratio 1 (V4.1) has nothing to pool: the latent is
    the normalised projection, with no gate and no float32."""

    def __init__(self, w: Weights, prefix: str, ratio: int, width: int) -> None:
        self.ratio, self.width, self.overlap = ratio, width, ratio == 4
        self.eps = w.config.norm_eps
        self.ape = w.float(f"{prefix}.ape") if f"{prefix}.ape" in w.tensors else None
        self.wkv = Linear(w.float(f"{prefix}.wkv.weight"))
        self.wgate = Linear(w.float(f"{prefix}.wgate.weight")) if ratio > 1 else None
        self.norm = w.float(f"{prefix}.norm.weight")

    def __call__(self, x: torch.Tensor, start: int, st: CompressorState | None, num: Numerics) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed tokens start … start+T−1; return the latents completed by them [n, width] and
        their positions [n]."""
        ratio, width = self.ratio, self.width
        if self.wgate is None:
            return rms_norm(self.wkv(x, num), self.norm, self.eps), torch.arange(start, start + x.shape[0])
        positions = torch.arange(start, start + x.shape[0])
        kv = self.wkv(x, num, torch.float32)
        score = self.wgate(x, num, torch.float32)
        if self.ape is not None:
            score = score + self.ape[positions % ratio]
        cur = ratio if self.overlap else 0  # first row of the current group in the state
        pending = start % ratio
        kv = torch.cat((st.kv[cur : cur + pending], kv))
        score = torch.cat((st.score[cur : cur + pending], score))
        n = kv.shape[0] // ratio
        done = n * ratio
        first_group = (start - pending) // ratio
        groups_kv = kv[:done].view(n, ratio, kv.shape[1])
        groups_score = score[:done].view(n, ratio, kv.shape[1])
        if n and self.overlap:
            prev_kv = torch.cat((st.kv[None, :ratio], groups_kv[:-1]))[..., :width]
            prev_score = torch.cat((st.score[None, :ratio], groups_score[:-1]))[..., :width]
            if first_group == 0:  # the sequence's first group has no predecessor
                prev_score[0] = float("-inf")
            pool_kv = torch.cat((prev_kv, groups_kv[..., width:]), dim=1)
            pool_score = torch.cat((prev_score, groups_score[..., width:]), dim=1)
        else:
            pool_kv, pool_score = groups_kv, groups_score
        # Update the partial-group state: leftovers become the current group, the last
        # complete group becomes the overlap slots.
        left = kv.shape[0] - done
        st.kv[cur : cur + left] = kv[done:]
        st.score[cur : cur + left] = score[done:]
        st.kv[cur + left :] = 0  # keep unused slots canonical so equal states serialise equally
        st.score[cur + left :] = float("-inf")
        if n and self.overlap:
            st.kv[:ratio] = groups_kv[-1]
            st.score[:ratio] = groups_score[-1]
        entry_pos = (first_group + torch.arange(n)) * ratio
        if not n:
            return torch.zeros(0, width, dtype=num.dtype), entry_pos
        entries = (pool_kv.to(ACC) * pool_score.to(ACC).softmax(dim=1)).sum(dim=1).float()
        return rms_norm(entries.to(num.dtype), self.norm, self.eps), entry_pos


class IndexScorer:
    """The lightning indexer's scores score(i, j) = Σ_h w_h · ReLU(q_h · K_j): query heads
    q = wq_b(qr) with RoPE on their last dims (V4 then rotates them by a Hadamard matrix, V4.1 does
    not) and FP4-quantised in reference numerics; per-head weights w = weights_proj(x)·(d·H)^-½."""

    def __init__(self, w: Weights, prefix: str, rope: Rope, hadamard: bool) -> None:
        c = w.config
        self.n_heads, self.head_dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.rope, self.hadamard = rope, hadamard
        self.wq_b = w.linear(f"{prefix}.wq_b")
        self.weights_proj = Linear(w.float(f"{prefix}.weights_proj.weight"))

    def scores(self, x: torch.Tensor, qr: torch.Tensor, cos_sin, keys: torch.Tensor, num: Numerics) -> torch.Tensor:
        """float32 [T, n_entries] (every entry, visible or not)."""
        q = self.wq_b(qr, num).view(x.shape[0], self.n_heads, self.head_dim)
        q = self.rope.apply(q, cos_sin)
        if num.quantize:
            q = quant.fp4_fake_quant_ue8m0(quant.hadamard_transform(q) if self.hadamard else q, INDEX_FP4_BLOCK)
        weights = self.weights_proj(x, num).float() * (self.head_dim**-0.5 * self.n_heads**-0.5)
        dots = torch.einsum("thd,nd->thn", q.to(ACC), keys.to(ACC)).float().to(num.dtype).float()
        return (F.relu(dots) * weights.unsqueeze(-1)).to(ACC).sum(dim=1).float().to(num.dtype).float()


INDEX_FP4_BLOCK = 32  # indexer queries and keys: FP4 with ue8m0 scales per 32


class SparseAttention:
    """Shared-KV MQA (one head_dim-wide head that is both K and V) over the sliding window plus
    whatever compressed entries the family adds (`compressed`), with attention sinks, inverse RoPE
    on the output and the grouped output projection.

    Window semantics: query i sees positions max(0, i−W+1) … i; the ring holds the W newest."""

    q_head_norm: bool  # V4 normalises each query head (unweighted); V4.1 does not
    window_format: PackedRows | None = None  # the ring's packed rows (V4.1 in reference numerics)

    def __init__(self, w: Weights, prefix: str, ratio: int) -> None:
        c = w.config
        self.c, self.ratio = c, ratio
        self.n_heads, self.head_dim, self.window = c.n_heads, c.head_dim, c.window_size
        if ratio:
            yarn = (c.rope_factor, c.original_seq_len, c.beta_fast, c.beta_slow) if c.original_seq_len else None
            self.rope = Rope(c.rope_head_dim, c.compress_rope_theta, yarn)
        else:  # window-only layers: base theta, no YaRN
            self.rope = Rope(c.rope_head_dim, c.rope_theta)
        self.sink = w.float(f"{prefix}.attn_sink")
        self.wq_a = w.linear(f"{prefix}.wq_a")
        self.q_norm = w.float(f"{prefix}.q_norm.weight")
        self.wq_b = w.linear(f"{prefix}.wq_b")
        self.wkv = w.linear(f"{prefix}.wkv")
        self.kv_norm = w.float(f"{prefix}.kv_norm.weight")
        # wo_a: the reference dequantises it and runs a bf16 einsum without activation quantisation.
        self.wo_a = Linear(w.linear(f"{prefix}.wo_a").weight)
        self.wo_b = w.linear(f"{prefix}.wo_b")

    def quantize_kv(self, kv: torch.Tensor, num: Numerics) -> torch.Tensor:
        """The window KV's fake-quant, where the family does it outside the ring's packed format."""
        return kv

    def compressed(self, seg: Segment, x, qr, cos_sin, num: Numerics, shared) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The compressed keys [n, head_dim] one sequence attends to beyond the window, and which of
        them each query sees [T, n]; None for window-only layers."""
        return None

    def __call__(self, x: torch.Tensor, segments: list[Segment], num: Numerics, shared: list | None = None) -> torch.Tensor:
        """x holds the new rows of every sequence in the batch; the projections run on all rows at
        once, the attention proper on each sequence's rows against its own state. `shared` holds
        per sequence what the layers hand down the stack within one forward (V4.1)."""
        c = self.c
        positions = torch.cat([seg.positions for seg in segments])
        cos_sin = self.rope.cos_sin(positions)

        qr = rms_norm(self.wq_a(x, num), self.q_norm, c.norm_eps)
        q = self.wq_b(qr, num).view(x.shape[0], self.n_heads, self.head_dim)
        if self.q_head_norm:
            q = rms_norm(q, None, c.norm_eps)  # unweighted, per head
        q = self.rope.apply(q, cos_sin)

        kv = rms_norm(self.wkv(x, num), self.kv_norm, c.norm_eps)
        kv = self.quantize_kv(self.rope.apply(kv, cos_sin), num)

        o = torch.cat([
            self._attend(seg, x[seg.rows], qr[seg.rows], q[seg.rows], kv[seg.rows], (cos_sin[0][seg.rows], cos_sin[1][seg.rows]), num, shared[i] if shared else None)
            for i, seg in enumerate(segments)
        ])
        o = self.rope.apply(o, cos_sin, inverse=True)
        groups = o.reshape(x.shape[0], c.o_groups, -1)
        wo_a = self.wo_a.weight.view(c.o_groups, c.o_lora_rank, -1)
        o = torch.einsum("tgd,grd->tgr", groups.to(ACC), wo_a).float().to(num.dtype)
        return self.wo_b(o.flatten(1), num)

    def _attend(self, seg: Segment, x, qr, q, kv, cos_sin, num: Numerics, shared) -> torch.Tensor:
        """One sequence: window keys from its ring plus this chunk, the compressed entries, sinks."""
        st, start, positions, W = seg.layer_state, seg.start, seg.positions, self.window
        stored = store_rows(kv, self.window_format, num)
        kv = load_rows(stored, self.window_format, num)  # what attention sees: the cached form
        earlier = torch.arange(max(0, start - (W - 1)), start)  # up to W−1 earlier positions
        keys = torch.cat((load_rows(st.window[earlier % W], self.window_format, num), kv))
        key_pos = torch.cat((earlier, positions))
        mask = (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] > positions[:, None] - W)
        keep = positions[-W:]
        st.window[keep % W] = stored[-W:]
        extra = self.compressed(seg, x, qr, cos_sin, num, shared)
        if extra is not None:
            keys = torch.cat((keys, extra[0]))
            mask = torch.cat((mask, extra[1]), dim=1)
        return sink_attention(q, keys, mask, self.sink, self.head_dim**-0.5, num)


# ---- mixture of experts ---------------------------------------------------------------------------


@dataclass
class Expert:
    """SwiGLU with the clamp (`limit` > 0): gate ≤ limit, up ∈ [−limit, limit]. The routing weight
    multiplies before w2 (so it is inside w2's input quantisation)."""

    w1: Linear
    w2: Linear
    w3: Linear
    limit: float

    def __call__(self, x: torch.Tensor, num: Numerics, weight: torch.Tensor | None = None) -> torch.Tensor:
        gate = self.w1(x, num, torch.float32)
        up = self.w3(x, num, torch.float32)
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        h = f64(F.silu, gate) * up
        if weight is not None:
            h = weight * h
        return self.w2(h.to(num.dtype), num)


@dataclass
class MoE:
    """sqrt-softplus scoring; top-k on score + bias (or a fixed tid2eid table for hash layers);
    weights = normalised scores × route_scale; routed experts plus the shared expert."""

    gate: torch.Tensor  # [E, D] float64
    bias: torch.Tensor | None  # [E] float32, noaux load-balancing correction (selection only)
    tid2eid: torch.Tensor | None  # [vocab, k] int64 for hash-routed layers
    experts: list[Expert]
    shared: Expert
    top_k: int
    route_scale: float
    bias_vl: torch.Tensor | None = None  # V4.1: the correction for tokens inside image spans
    route_eps: float = 0.0  # V4.1 adds 1e-20 to the normaliser (as in training)

    def route(self, x: torch.Tensor, ids: torch.Tensor, image: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = f64(lambda z: F.softplus(z).sqrt(), acc_matmul(x, self.gate))
        if self.tid2eid is not None:
            idx = self.tid2eid[ids]
        else:
            bias = self.bias if self.bias_vl is None or image is None else torch.where(image[:, None], self.bias_vl, self.bias)
            idx = (scores + bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, idx)
        weights = weights / (weights.to(ACC).sum(dim=-1, keepdim=True) + self.route_eps).float() * self.route_scale
        return weights, idx

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, num: Numerics, image: torch.Tensor | None = None) -> torch.Tensor:
        weights, idx = self.route(x, ids, image)
        y = torch.zeros(x.shape, dtype=torch.float32)
        for e in idx.unique().tolist():
            rows, slot = torch.where(idx == e)
            y[rows] += self.experts[e](x[rows], num, weights[rows, slot, None]).float()
        y += self.shared(x, num).float()
        return y.to(num.dtype)


def moe_of(w: Weights, prefix: str, **routing) -> MoE:
    """The MoE under `prefix` (…ffn): its gate, routed experts and shared expert, SwiGLU-clamped;
    `routing` gives the family's bias / tid2eid / bias_vl / route_eps."""
    c = w.config

    def expert(p: str) -> Expert:
        return Expert(w.linear(f"{p}.w1"), w.linear(f"{p}.w2"), w.linear(f"{p}.w3"), c.swiglu_limit)

    n_experts, _ = c.n_experts_of(prefix)
    return MoE(
        gate=w.float(f"{prefix}.gate.weight").to(ACC),
        experts=[expert(f"{prefix}.experts.{e}") for e in range(n_experts)],
        shared=expert(f"{prefix}.shared_experts"),
        top_k=c.n_activated_experts,
        route_scale=c.route_scale,
        **routing,
    )


def hyper_connection(w: Weights, site: str) -> HyperConnection:
    """The mHC site `site` (e.g. layers.3.hc_attn): its fn, base and scale."""
    return HyperConnection(*(w.float(f"{site}_{k}") for k in ("fn", "base", "scale")))


# ---- the model interface ---------------------------------------------------------------------------


class ReferenceModel:
    """What the server's worker drives, the same for both families and for the GPU path
    (dsuf.gpu.model): `config` (name, vocab_size, eos_token_id), `new_state`, `free`, `forward`
    and `forward_batch`, and `export_state` / `import_state` between the model's own states and
    the SequenceStates that conversation caches serialise. A family implements `_forward` over a
    batch of (new tokens, state) pairs."""

    config: ModelConfig

    def new_state(self, num: Numerics) -> SequenceState:
        raise NotImplementedError

    def free(self, state: SequenceState) -> None:
        """A state is done with (the reference's states hold nothing but their tensors)."""

    def export_state(self, state: SequenceState) -> SequenceState:
        return state

    def import_state(self, state: SequenceState) -> SequenceState:
        return state

    def packs_caches(self, num: Numerics) -> bool:
        """Whether states made for `num` keep their cache rows packed (V4.1 in reference numerics)."""
        return False

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, state: SequenceState, num: Numerics, return_streams: bool = False, last_only: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Feed `tokens` [T] at positions state.pos …; return float32 logits [T, vocab] ([1, vocab]
        with `last_only`, all a sampler needs) and optionally the final residual streams
        [T, hc, D] (V4: the MTP layer's input)."""
        (logits,), x = self._forward([(tokens, state)], num, last_only)
        return (logits, x) if return_streams else logits

    @torch.inference_mode()
    def forward_batch(
        self, batch: list[tuple[torch.Tensor, SequenceState]], num: Numerics, last_only: bool = True
    ) -> list[torch.Tensor]:
        """Several sequences in one call (each with its own new tokens and state). Every row-wise
        computation runs on all rows together; the reference path is batch-invariant, so each
        sequence gets exactly the logits `forward` would give it alone."""
        return self._forward(batch, num, last_only)[0]

    @torch.inference_mode()
    def forward_batch_streams(
        self, batch: list[tuple[torch.Tensor, SequenceState]], num: Numerics
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """forward_batch's logits after each sequence's last token, and each sequence's final
        residual streams [T, hc, D] (the MTP layer's input)."""
        if not batch:
            return [], []
        logits, x = self._forward(batch, num, True)
        return logits, list(x.split([tokens.shape[0] for tokens, _ in batch]))

    def _forward(
        self, batch: list[tuple[torch.Tensor, SequenceState]], num: Numerics, last_only: bool
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        raise NotImplementedError

    def _rows(self, batch: list[tuple[torch.Tensor, SequenceState]], num: Numerics) -> list[tuple[slice, SequenceState]]:
        """Each sequence's rows in the batched call; its state must be one made for `num`."""
        offset, rows = 0, []
        for tokens, state in batch:
            if state.dtype != num.dtype:
                raise ValueError(f"state holds {state.dtype} activations, numerics asks for {num.dtype}")
            if state.packed != self.packs_caches(num):
                raise ValueError(f"state {'holds' if state.packed else 'lacks'} packed caches, numerics {num.mode} asks otherwise")
            rows.append((slice(offset, offset + tokens.shape[0]), state))
            offset += tokens.shape[0]
        return rows
