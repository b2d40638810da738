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
    gpu = GpuModel(c, t, device, max_batch=4, max_context=4096)
    with torch.device(device):
        ref = V4Model(c, t)
    yield c, gpu, ref, device
    del gpu, ref, t
    torch.cuda.empty_cache()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def reference_run(ref, c, device, prompt: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill then greedy decode on the reference path: the logits after the prompt and after each
    greedy token, and the tokens."""
    from dsuf.model.state import SequenceState

    with torch.device(device):
        state = SequenceState.new(c, NUM.dtype)
        logits = [ref.forward(prompt.to(device), state, NUM, last_only=True).float().reshape(-1)]
        tokens = []
        for _ in range(steps):
            tokens.append(int(logits[-1].argmax()))
            logits.append(ref.forward(torch.tensor([tokens[-1]], device=device), state, NUM, last_only=True).float().reshape(-1))
    return logits, tokens


def gpu_run(gpu, prompt: torch.Tensor, steps: int, seq=None) -> tuple[list[torch.Tensor], list[int], object]:
    seq = seq if seq is not None else gpu.new_state()
    logits = [gpu.forward_batch([(prompt, seq)])[0].reshape(-1)]
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits.append(gpu.forward_batch([(torch.tensor([tokens[-1]]), seq)])[0].reshape(-1))
    return logits, tokens, seq


def test_greedy_decode_matches_the_reference(models) -> None:
    c, gpu, ref, device = models
    prompt = torch.randint(0, c.vocab_size, (700,))  # crosses 5 HCA groups and 175 CSA groups
    want_logits, want = reference_run(ref, c, device, prompt, 12)
    got_logits, got, seq = gpu_run(gpu, prompt, 12)
    errors = [rel(g, w) for g, w in zip(got_logits, want_logits)]
    print(f"  logits rel err, after the prompt then each greedy token: {', '.join(f'{e:.1e}' for e in errors)}")
    print(f"  greedy tokens: gpu {got}\n                 ref {want}")
    assert max(errors) < 2e-2  # bf16 activations through 4 layers; the reference accumulates in float64
    assert got == want
    gpu.free(seq)


def test_a_state_exported_and_imported_continues_bit_for_bit(models) -> None:
    c, gpu, ref, device = models
    prompt = torch.randint(0, c.vocab_size, (301,))
    _, _, seq = gpu_run(gpu, prompt, 0)
    host = gpu.export_state(seq)
    assert host.pos == 301 and host.layers[2].compressed.shape[0] == 301 // 128 and host.layers[1].index_keys.shape[0] == 301 // 4
    twin = gpu.import_state(host)
    assert twin.slot != seq.slot and twin.pos == seq.pos
    nxt = torch.tensor([int(prompt[0])])
    a = gpu.forward_batch([(nxt, seq)])[0]
    b = gpu.forward_batch([(nxt, twin)])[0]
    assert torch.equal(a, b)
    # and the exported state is the reference's after the same prompt, to bf16 rounding
    from dsuf.model.state import SequenceState

    with torch.device(device):
        state = SequenceState.new(c, NUM.dtype)
        ref.forward(prompt.to(device), state, NUM, last_only=True)
    for i in (0, 1, 2, 3):
        r, g = state.layers[i], host.layers[i]
        print(f"  layer {i}: window rel err {rel(g.window, r.window):.1e}" + (f", compressed {rel(g.compressed, r.compressed):.1e}" if r.compressed is not None else ""))
        assert rel(g.window, r.window) < 2e-2
        if r.compressed is not None:
            assert rel(g.compressed, r.compressed) < 2e-2
            assert rel(g.compressor.kv, r.compressor.kv) < 2e-2
    gpu.free(seq)
    gpu.free(twin)


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
        assert rel(t, a) < 1e-2 and int(t.argmax()) == int(a.argmax())
    for s in seqs:
        gpu.free(s)


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
