"""Token sampling in the worker: one `Sampler` per sequence, fed that sequence's logits [vocab].

Order of operations for one token (every step is out of place; the caller's logits are untouched):

1. `logit_bias` is added to the logits;
2. frequency and presence penalties (OpenAI semantics) are subtracted, counted over the tokens this
   sampler has produced so far (the prompt does not count):
   ``logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)``;
   the result is the *processed* logits;
3. greedy (temperature 0): the argmax of the processed logits, ties to the lowest token id; the
   RNG is not touched, so the seed is irrelevant;
4. otherwise: divide by the temperature, keep the top-k (ties broken towards lower ids, so
   ``top_k=1`` is exactly greedy), softmax over what is kept, keep the nucleus (the smallest prefix
   of the descending probabilities whose mass reaches ``top_p``; the top token is always kept),
   and draw as `torch.multinomial` draws one sample (argmax of probabilities over Exp(1) noise)
   from the sequence's own `torch.Generator`, without waiting for the device.

Reported log-probabilities (`TokenChoice.logprob` and `.top`) are ``log_softmax`` of the processed
logits at temperature 1, before temperature, top-k and top-p: vLLM's default ("processed logprobs"
of the model distribution after penalties and bias), not the distribution actually sampled from.
"""

from __future__ import annotations

import math
import secrets

import msgspec
import torch

SEED_LIMIT = 2**63
MAX_TOP_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # temperatures this small are greedy: logits / T would overflow float32


class SamplingParams(msgspec.Struct, frozen=True):
    """How to pick the tokens of one sequence. Out-of-range values raise ValueError naming the field
    (when constructed directly; msgspec decoding reports it as msgspec.ValidationError, a ValueError)."""

    temperature: float = 1.0  # 0 => greedy; (0, 2]
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 => off
    seed: int | None = None  # [0, 2**63); same seed + same logits => same tokens
    frequency_penalty: float = 0.0  # [-2, 2]: logit -= frequency_penalty * count(token in generated tokens)
    presence_penalty: float = 0.0  # [-2, 2]: logit -= presence_penalty * (count > 0)
    logprobs: bool = False  # informational: TokenChoice.logprob is always filled in
    top_logprobs: int = 0  # 0..20: TokenChoice.top holds this many (token, logprob) pairs
    logit_bias: dict[int, float] | None = None  # token -> added to its logit before anything else; -inf bans it
    forced: list[int] | None = None  # test hook: emit these tokens first, in order, then sample as usual

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError, naming the field, for any out-of-range value (NaN is out of every range)."""
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if any(t < 0 for t in self.forced or ()):
            raise ValueError("forced token ids must be >= 0")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token!r}")
            if math.isnan(bias) or bias == math.inf:
                raise ValueError(f"logit_bias values must be finite or -inf, got {bias!r} for token {token}")


class TokenChoice(msgspec.Struct):
    """One sampled token.

    `logprob` is log_softmax of the processed logits (after logit_bias and penalties) at
    temperature 1, i.e. before temperature, top-k and top-p — vLLM's default, not the probability of
    the truncated, tempered distribution the token was actually drawn from. `top` uses the same
    distribution: the `top_logprobs` most likely tokens, descending, or None when not requested."""

    token: int
    logprob: float
    top: list[tuple[int, float]] | None = None


class Sampler:
    """Per-sequence sampling state: the RNG (torch.Generator seeded from params.seed, or from a fresh
    random seed when None) and the generated-token counts for penalties.

    The generator and the counts live on the device of the first logits passed to `sample` (later
    logits are moved there). Tokens are reproducible for the same seed, logits and device, whatever
    else runs in the process: nothing here reads or advances torch's global RNG."""

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        params.validate()
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        bias = params.logit_bias or {}
        bad = [t for t in [*bias, *(params.forced or ())] if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias and forced token ids must be < vocab_size {vocab_size}, got {sorted(bad)}")
        self.params = params
        self.vocab_size = vocab_size
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(63)
        self.greedy = params.temperature < GREEDY_BELOW
        self.top_k = min(params.top_k, vocab_size)  # 0 => off
        self.num_generated = 0
        self._penalised = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        self._bias_items = sorted(bias.items())
        self._device: torch.device | None = None
        self._generator: torch.Generator | None = None
        self._counts: torch.Tensor | None = None  # float32 [vocab] on the device, only when penalised
        self._recorded_early: list[int] = []
        self._bias_ids: torch.Tensor | None = None
        self._bias_values: torch.Tensor | None = None

    def _bind(self, device: torch.device) -> None:
        self._device = device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(self.seed)
        if self._penalised:
            self._counts = torch.zeros(self.vocab_size, dtype=torch.float32, device=device)
            for token in self._recorded_early:  # recorded before any logits told us the device
                self._counts[token] += 1
        if self._bias_items:
            self._bias_ids = torch.tensor([t for t, _ in self._bias_items], dtype=torch.int64, device=device)
            self._bias_values = torch.tensor([b for _, b in self._bias_items], dtype=torch.float32, device=device)

    def processed_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after logit_bias and penalties (float32 or float64, a new tensor or the input)."""
        if logits.dim() != 1 or logits.shape[0] != self.vocab_size:
            raise ValueError(f"logits must have shape [{self.vocab_size}], got {list(logits.shape)}")
        if not logits.is_floating_point():
            raise ValueError(f"logits must be floating point, got {logits.dtype}")
        if self._device is None:
            self._bind(logits.device)
        x = logits.to(self._device)
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        if self._bias_ids is not None:
            x = x.index_add(0, self._bias_ids, self._bias_values.to(x.dtype))
        if self._counts is not None and self.num_generated:
            p = self.params
            counts = self._counts.to(x.dtype)
            x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(x.dtype)
        return x

    def record(self, token: int) -> None:
        """Count `token` as generated (for penalties), e.g. a token restored after preemption;
        `sample` and `draw` do this themselves."""
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token {token} outside the vocabulary [0, {self.vocab_size})")
        if self._counts is not None:
            self._counts[token] += 1
        elif self._device is None and self._penalised:
            self._recorded_early.append(token)
        self.num_generated += 1

    def sample(self, logits: torch.Tensor) -> TokenChoice:
        """Pick the next token from this sequence's logits [vocab] and record it for penalties."""
        return self.draw(logits).choice()

    def draw(self, logits: torch.Tensor) -> Draw:
        """`sample` without waiting for the device: the token stays a tensor on the logits' device
        (the GPU path feeds it to the next step before the host reads it); `Draw.choice` reads it.
        The token is recorded for penalties on the device."""
        p = self.params
        x = self.processed_logits(logits)
        logprobs = torch.log_softmax(x, dim=-1)
        if p.forced and self.num_generated < len(p.forced):
            token = torch.full((1,), p.forced[self.num_generated], dtype=torch.int64, device=x.device)
        elif self.greedy:
            token = torch.argmax(x).view(1)  # first maximum: ties go to the lowest id
        else:
            scaled = x / p.temperature
            if self.top_k == 0 and p.top_p >= 1.0:
                token = self._race(torch.softmax(scaled, dim=-1))
            else:
                # Stable descending sort: equal logits keep ascending ids, so truncation prefers low ids.
                values, ids = torch.sort(scaled, descending=True, stable=True)
                if self.top_k:
                    values, ids = values[: self.top_k], ids[: self.top_k]
                probs = torch.softmax(values, dim=-1)
                if p.top_p < 1.0:
                    mass_before = torch.cumsum(probs, dim=-1) - probs
                    drop = mass_before >= p.top_p
                    drop[0] = False
                    probs = probs.masked_fill(drop, 0.0)
                token = ids[self._race(probs)]
        top = torch.topk(logprobs, min(p.top_logprobs, self.vocab_size)) if p.top_logprobs else None
        if self._counts is not None:
            self._counts.index_add_(0, token, torch.ones(1, dtype=self._counts.dtype, device=token.device))
        self.num_generated += 1
        return Draw(token, logprobs.gather(0, token), top, bool(p.forced))

    def _race(self, probs: torch.Tensor) -> torch.Tensor:
        """One draw from probs: argmax of probs / Exp(1) noise, which is how torch.multinomial
        draws one sample (the same tokens for the same generator), without its check of the
        probabilities on the host, which would wait for the device."""
        noise = torch.empty_like(probs).exponential_(1, generator=self._generator)
        return torch.argmax(probs / noise).view(1)


class Draw:
    """A token drawn on the device (`token`: int64 [1]) and what its TokenChoice needs, on their
    way to the host: copied as soon as they are computed, so that reading them waits for the draw
    and not for what is queued on the device after it (the next step, when the worker looks ahead)."""

    def __init__(self, token: torch.Tensor, logprob: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None, forced: bool) -> None:
        self.token, self._forced = token, forced
        parts = [token, logprob, *(top.indices, top.values)] if top is not None else [token, logprob]
        self._k = top.indices.numel() if top is not None else 0
        values = torch.cat([t.double() for t in parts])  # token ids are exact in float64
        self._ready: torch.cuda.Event | None = None
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = values

    def choice(self) -> TokenChoice:
        """The token and its log-probability on the host (waits for the draw only)."""
        if self._ready is not None:
            self._ready.synchronize()
        values = self._host.tolist()
        token, logprob = int(values[0]), values[1]
        if not math.isfinite(logprob) and not self._forced:  # every logit -inf, or NaN from the model
            raise ValueError(f"no valid token to sample: processed logits are not finite (picked {token}, logprob {logprob})")
        top = list(zip((int(i) for i in values[2 : 2 + self._k]), values[2 + self._k :])) if self._k else None
        return TokenChoice(token, logprob, top)
