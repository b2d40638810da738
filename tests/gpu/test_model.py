"""The GPU path end to end (dsuf.gpu.model) against the reference model on the same weights.

A four-layer model of V4-Flash's real layer shapes (an SWA, a CSA, an HCA and a CSA layer; 16
experts, all layers but the last hash-routed, the last with a bias wide enough that its top-6
cannot flip on rounding) with random weights in checkpoint formats, on the GPU. Prompts stay below
4 x 512 tokens, so the indexer keeps every visible entry: with random weights a one-ulp difference
can otherwise flip a top-k pick, which says nothing about either path.
"""

from __future__ import annotations

import pytest
import torch

from dsuf.model.config import parse_config
from dsuf.model.layers import Numerics

LAYERS = 4
# How far apart two runs of this random-weight model may land when they differ only in summation
# order (batching splits attention and groups MoE pairs differently): twice what the reference
# itself moves when 1% of its embedding values move one bf16 ulp (0.06-0.08 measured on H200).
CHAOS = 0.15
NUM = Numerics()  # reference numerics: bf16 activations, FP8 / FP4 fake-quant where the kernels quantise


def small_config():
    from dsuf.gpu.weights import V4_FLASH_CONFIG

    raw = dict(V4_FLASH_CONFIG, num_hidden_layers=LAYERS, compress_ratios=[0, 4, 128, 4], n_routed_experts=16, num_hash_layers=3,
               num_nextn_predict_layers=0)
    return parse_config(raw, "v4-flash-4-layers")


@pytest.fixture(scope="module")
def models():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    from dsuf.gpu.model import GpuModel
    from dsuf.gpu.weights import model_tensors
    from dsuf.model.v4 import V4Model

    print(f"\n  seed {torch.seed()}")
    device = torch.device("cuda")
    c = small_config()
    t = model_tensors(c, device)
    t["layers.3.ffn.gate.bias"] = 10 * torch.randn(c.n_routed_experts, device=device)
    with torch.device(device):
        ref = V4Model(c, t)
    gpu = GpuModel(c, t, device, max_batch=4, max_context=4096)  # takes the tensors over (the reference keeps its own references)
    yield c, gpu, ref, device
    del gpu, ref, t
    torch.cuda.empty_cache()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def reference_logits(ref, c, device, tokens: torch.Tensor, prompt_len: int, state=None) -> list[torch.Tensor]:
    """Prefill tokens[:prompt_len] on the reference path, then feed the rest one at a time: the
    logits after the prompt and after each later token."""
    from dsuf.model.state import SequenceState

    with torch.device(device):
        state = state if state is not None else SequenceState.new(c, NUM.dtype)
        out = [ref.forward(tokens[:prompt_len].to(device), state, NUM, last_only=True).reshape(-1).cpu()]
        for t in tokens[prompt_len:]:
            out.append(ref.forward(t.view(1).to(device), state, NUM, last_only=True).reshape(-1).cpu())
    return out


def gpu_logits(gpu, tokens: torch.Tensor, prompt_len: int, seq) -> list[torch.Tensor]:
    out = [gpu.forward_batch([(tokens[:prompt_len], seq)])[0].reshape(-1)]
    for t in tokens[prompt_len:]:
        out.append(gpu.forward_batch([(t.view(1), seq)])[0].reshape(-1))
    return out


def test_logits_follow_the_reference_as_closely_as_the_reference_follows_itself(models, monkeypatch) -> None:
    """With random weights the model is chaotic: FP8 activation rounding turns a one-ulp input
    change into a different rounding of some elements, which moves the logits by percents and
    flips the argmax where the top two are close. So the GPU path's logits (fed the same tokens)
    must stay as close to the reference's as the reference's own stay when 1% of its embedding
    values move by one bf16 ulp, and the argmax must agree wherever the reference's margin is
    wider than that movement. The prompt's routed experts run in the decode kernels here, whose
    sums are the reference's bit for bit: moe_prefill_fp4's (wgmma, ~13 bits a 128-element chunk)
    move h's FP8 roundings, which this chaos amplifies beyond the nudge's (0.22 against 0.15 on
    one seed); test_moe bounds them against the reference."""
    from dsuf.gpu import moe as gpu_moe

    monkeypatch.setattr(gpu_moe, "PREFILL_MIN_TOKENS", gpu_moe.GROUPED_MIN_TOKENS)
    c, gpu, ref, device = models
    tokens = torch.randint(0, c.vocab_size, (712,))  # a 700-token prompt (5 HCA and 175 CSA groups), then 12 decode steps
    want = reference_logits(ref, c, device, tokens, 700)
    embed = ref.embed.clone()
    nudged = ref.embed.view(-1)
    nudged[::100] = (nudged[::100].float() * (1 + 2**-7)).to(nudged.dtype)
    try:
        moved = reference_logits(ref, c, device, tokens, 700)
    finally:
        ref.embed.copy_(embed)
    seq = gpu.new_state()
    got = gpu_logits(gpu, tokens, 700, seq)
    gpu.free(seq)
    errors, noise = [rel(g, w) for g, w in zip(got, want)], [rel(m, w) for m, w in zip(moved, want)]
    print(f"  logits rel err, GPU vs reference:       {', '.join(f'{e:.1e}' for e in errors)}")
    print(f"  logits rel err, nudged reference vs it: {', '.join(f'{e:.1e}' for e in noise)}")
    assert max(errors) <= max(2 * max(noise), 1e-2)
    clear = 0
    for g, w, m in zip(got, want, moved):
        top = w.topk(2).values
        if top[0] - top[1] > 2 * (m - w).abs().max():
            clear += 1
            assert int(g.argmax()) == int(w.argmax())
    print(f"  argmax equal at all {clear} of {len(want)} steps where the reference's margin is clear of its own noise")


def test_a_state_exported_and_imported_continues_bit_for_bit(models) -> None:
    c, gpu, ref, device = models
    prompt = torch.randint(0, c.vocab_size, (301,))
    seq = gpu.new_state()
    gpu.forward_batch([(prompt, seq)])
    host = gpu.export_state(seq)
    assert host.pos == 301 and host.layers[2].compressed.shape[0] == 301 // 128 and host.layers[1].index_keys.shape[0] == 301 // 4
    twin = gpu.import_state(host)
    assert twin.slot != seq.slot and twin.pos == seq.pos
    nxt = torch.tensor([int(prompt[0])])
    a = gpu.forward_batch([(nxt, seq)])[0]
    b = gpu.forward_batch([(nxt, twin)])[0]
    assert torch.equal(a, b)
    # The exported state is in the reference's layout: the reference continues from it.
    from_ref = reference_logits(ref, c, device, nxt, 1, state=to_device(host, device))[0]
    print(f"  next-token logits, reference from the exported state vs GPU: rel err {rel(from_ref, a):.1e}")
    assert rel(from_ref, a) < CHAOS  # a wrong layout gives ~1.4 (unrelated logits)
    gpu.free(seq)
    gpu.free(twin)


def to_device(host, device):
    """A SequenceState's tensors moved to the device (the reference path runs there in these tests)."""
    from dsuf.model.state import CompressorState

    for ls in host.layers:
        for name, value in vars(ls).items():
            if isinstance(value, torch.Tensor):
                setattr(ls, name, value.to(device))
            elif isinstance(value, CompressorState):
                setattr(ls, name, CompressorState(value.kv.to(device), value.score.to(device)))
    return host


def test_a_batch_gives_each_sequence_what_it_gets_alone(models) -> None:
    c, gpu, _, _ = models
    prompts = [torch.randint(0, c.vocab_size, (n,)) for n in (37, 5, 130)]
    alone = []
    for p in prompts:
        seq = gpu.new_state()
        alone.append(gpu.forward_batch([(p, seq)])[0])
        gpu.free(seq)
    seqs = [gpu.new_state() for _ in prompts]
    together = gpu.forward_batch(list(zip(prompts, seqs)))
    for a, t in zip(alone, together):
        print(f"  batched vs alone: rel err {rel(t, a):.1e}")
        assert rel(t, a) < CHAOS  # rows mixed up would give ~1.4
    for s in seqs:
        gpu.free(s)


def test_a_prompt_fed_in_chunks_computes_what_it_computes_token_by_token(models) -> None:
    """forward_batch runs a prompt shorter than PREFILL_MIN as one step of its rows (the rows of a
    chunk share its compressor states in order, and the ring keeps every window position a row
    reads): the logits and every cached tensor agree with feeding the same prompt one token a step.
    Two such prompts, a conversation's turns: windows, HCA and CSA groups across the edge."""
    from gpu_checks import state_tensors

    c, gpu, _, _ = models
    from dsuf.gpu.model import PREFILL_MIN

    prompt = torch.randint(0, c.vocab_size, (PREFILL_MIN + 200,))
    seq = gpu.new_state()
    gpu.forward_batch([(prompt[: PREFILL_MIN - 1], seq)])
    chunked = gpu.forward_batch([(prompt[PREFILL_MIN - 1 :], seq)])[0]
    by_chunk = state_tensors(gpu.export_state(seq))
    gpu.free(seq)
    seq = gpu.new_state()
    for t in prompt:
        alone = gpu.forward_batch([(t.view(1), seq)])[0]
    by_token = state_tensors(gpu.export_state(seq))
    gpu.free(seq)
    errors = [rel(a.float(), b.float()) for a, b in zip(by_chunk, by_token) if b.numel()]
    print(f"  chunked vs token by token: logits rel err {rel(chunked, alone):.1e}, cached tensors up to {max(errors):.1e}")
    assert rel(chunked, alone) < CHAOS and max(errors) < CHAOS  # a misplaced entry or state row gives ~1


def test_a_long_prompt_prefilled_in_large_chunks_computes_what_the_steps_compute(models) -> None:
    """A prompt of PREFILL_MIN tokens or more is prefilled outside the step graphs, prefill_rows
    rows a chunk (FP8 linears and the MoE on the tensor cores over bf16 weight copies, KV through
    the scratch entries, the compressors' groups in parallel): the logits, every cached tensor and
    the decode steps after it agree with the same prompt fed through the steps. Chunks of 1024 and
    200 rows: across a chunk edge, with and without the grouped MoE (moe_prefill_fp4's sums)."""
    from gpu_checks import state_tensors

    from dsuf.gpu.model import PREFILL_MIN

    c, gpu, _, _ = models
    prompt = torch.randint(0, c.vocab_size, (1224,))
    after = torch.randint(0, c.vocab_size, (3,))
    held, gpu.prefill_rows = gpu.prefill_rows, 1024
    try:
        seq = gpu.new_state()
        prefilled = [gpu.forward_batch([(prompt, seq)])[0]]
        prefilled_state = state_tensors(gpu.export_state(seq))
        prefilled += [gpu.forward_batch([(t.view(1), seq)])[0] for t in after]
        gpu.free(seq)
    finally:
        gpu.prefill_rows = held
    def steps() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        seq = gpu.new_state()
        for lo in range(0, len(prompt), PREFILL_MIN - 1):  # pieces too short for the prefill path
            logits = [gpu.forward_batch([(prompt[lo : lo + PREFILL_MIN - 1], seq)])[0]]
        state = state_tensors(gpu.export_state(seq))
        logits += [gpu.forward_batch([(t.view(1), seq)])[0] for t in after]
        gpu.free(seq)
        return logits, state

    stepped, stepped_state = steps()
    # This seed's chaos: how far the same steps land when 1% of the embedding values move one ulp.
    embed = gpu.embed.clone()
    gpu.embed.view(-1)[::100] = (gpu.embed.view(-1)[::100].float() * (1 + 2**-7)).to(gpu.embed.dtype)
    try:
        nudged, nudged_state = steps()
    finally:
        gpu.embed.copy_(embed)
    noise = max(rel(a, b) for a, b in zip(nudged, stepped))
    state_noise = max(rel(a.float(), b.float()) for a, b in zip(nudged_state, stepped_state) if b.numel())
    logits = [rel(a, b) for a, b in zip(prefilled, stepped)]
    errors = [rel(a.float(), b.float()) for a, b in zip(prefilled_state, stepped_state) if b.numel()]
    print(f"  prefilled vs stepped: logits rel err {', '.join(f'{e:.1e}' for e in logits)}, cached tensors up to {max(errors):.1e}")
    print(f"  nudged vs stepped (this seed's chaos): logits up to {noise:.1e}, cached tensors up to {state_noise:.1e}")
    # Within twice the chaos (at least 0.1); a misplaced entry or state row gives ~1.
    assert max(logits) <= max(2 * noise, 0.1) and max(errors) <= max(2 * state_noise, 0.1)


def test_cuda_graph_replays_equal_eager_steps(models) -> None:
    c, gpu, _, _ = models
    prompt = torch.randint(0, c.vocab_size, (9,))
    seq = gpu.new_state()
    replayed = gpu.forward_batch([(prompt, seq)])[0]
    gpu.free(seq)
    gpu.graphs = False
    try:
        seq = gpu.new_state()
        eager = gpu.forward_batch([(prompt, seq)])[0]
        gpu.free(seq)
    finally:
        gpu.graphs = True
    assert torch.equal(replayed, eager)


@pytest.mark.parametrize("late", ["mhc sinkhorn", "shared expert"])
def test_work_on_side_streams_is_awaited_where_it_is_used(models, monkeypatch, late) -> None:
    """Each mHC site's post and comb come from a side stream while the block runs, and so does the
    shared expert's output while the router's selection and the routed experts run: either
    finishing 0.5 ms late (a sleep queued before it) changes nothing, bit for bit."""
    from dsuf.gpu.mhc import HcSite
    from dsuf.gpu.moe import Moe

    c, gpu, _, _ = models
    prompt = torch.randint(0, c.vocab_size, (9,))

    def run() -> torch.Tensor:
        seq = gpu.new_state()
        out = [gpu.forward_batch([(prompt, seq)])[0]] + [gpu.forward_batch([(t.view(1), seq)])[0] for t in prompt[:3]]
        gpu.free(seq)
        return torch.stack(out)

    def delayed(f):
        return lambda *args, **kwargs: (torch.cuda._sleep(1_000_000), f(*args, **kwargs))[1]

    gpu.graphs = False  # eager: the patched kernel runs
    try:
        on_time = run()
        owner, name = (HcSite, "_from_mixes") if late == "mhc sinkhorn" else (Moe, "shared_forward")
        monkeypatch.setattr(owner, name, delayed(getattr(owner, name)))
        late_out = run()
    finally:
        gpu.graphs = True
    assert torch.equal(on_time, late_out)


def test_tokens_still_on_the_gpu_feed_what_the_same_tokens_from_the_host_feed(models) -> None:
    """The worker's look-ahead feeds sampled tokens before the host has read them: the same
    logits, bit for bit, as the same tokens given from the host."""
    c, gpu, _, device = models
    prompt = torch.randint(0, c.vocab_size, (20,))
    nxt = torch.randint(0, c.vocab_size, (2,))
    seqs = [gpu.new_state(), gpu.new_state()]
    for seq in seqs:
        gpu.forward_batch([(prompt, seq)])
    from_host = gpu.forward_batch([(nxt[i : i + 1], seq) for i, seq in enumerate(seqs)])
    for seq in seqs:
        gpu.free(seq)
    seqs = [gpu.new_state(), gpu.new_state()]
    for seq in seqs:
        gpu.forward_batch([(prompt, seq)])
    from_gpu = gpu.forward_batch([(nxt[i : i + 1].to(device), seq) for i, seq in enumerate(seqs)])
    assert all(torch.equal(a, b) for a, b in zip(from_host, from_gpu)) and all(seq.pos == 21 for seq in seqs)
    for seq in seqs:
        gpu.free(seq)


def test_sequences_beyond_the_context_or_the_slots_are_refused(models) -> None:
    c, gpu, _, _ = models
    seq = gpu.new_state()
    with pytest.raises(ValueError, match="exceeds"):
        gpu.forward_batch([(torch.zeros(gpu.max_context + 1, dtype=torch.int64), seq)])
    held = [gpu.new_state() for _ in range(len(gpu.free_slots))]
    with pytest.raises(RuntimeError, match="slots"):
        gpu.new_state()
    for s in held + [seq]:
        gpu.free(s)


# V4-Flash's layer shapes (the ones the kernels are written for) in a four-layer, eight-expert checkpoint.
GPU_TINY = {
    "hidden_size": 4096, "head_dim": 512, "num_attention_heads": 64, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "moe_intermediate_size": 2048, "n_routed_experts": 8,
    "num_experts_per_tok": 6, "num_hidden_layers": 4, "num_hash_layers": 4, "sliding_window": 128, "vocab_size": 4096,
    "num_nextn_predict_layers": 1, "compress_ratios": [0, 4, 128, 4, 0],
}


def test_a_checkpoint_in_the_released_layout_runs_on_the_gpu(tmp_path) -> None:
    """dsuf make-tiny's layout (per-expert tensors, safetensors shards, E8M0 scales) loaded onto the
    GPU path: the same logits as the reference model from the same files."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    from dsuf.gpu.model import GpuModel
    from dsuf.model.checkpoint import load_tensors
    from dsuf.model.tiny import make_tiny
    from dsuf.model.v4 import V4Model

    device = torch.device("cuda")
    c = make_tiny(tmp_path / "ckpt", "v4", seed=11, overrides=GPU_TINY)
    tensors = {k: v.to(device) for k, v in load_tensors(tmp_path / "ckpt", c).items()}
    with torch.device(device):
        ref = V4Model(c, tensors)
    gpu = GpuModel(c, tensors, device, max_batch=2, max_context=1024)
    tokens = torch.randint(0, c.vocab_size, (140,))  # past a window, an HCA group and many CSA groups
    want = reference_logits(ref, c, device, tokens, 136)
    seq = gpu.new_state()
    got = gpu_logits(gpu, tokens, 136, seq)
    errors = [rel(g, w) for g, w in zip(got, want)]
    print(f"  tiny checkpoint on the GPU: logits rel err {', '.join(f'{e:.1e}' for e in errors)}")
    assert max(errors) < CHAOS
