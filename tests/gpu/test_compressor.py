"""compress_decode (kernels_cu/compressor.cu) against the reference compressor: layers.Compressor
driven through identity projections (x = [kv, score], so wkv(x) = kv and wgate(x) = score
exactly), then v4.Compressor's RoPE at the entry's position and the cache formats (pack_kv;
quant.hadamard_transform + pack_index_keys). Each row decodes a run of tokens from its own
position, through every phase of its groups and the first group, with padding rows in the batch.
The state must match the reference bit for bit; the entries (float64 pooling and norm statistics)
to the last bit nearly everywhere."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gpu_checks import compare

from dsuf.gpu.attention import KV_ENTRY_BYTES, pack_kv
from dsuf.gpu.compressor import compress_chunk, compress_decode
from dsuf.gpu.indexer import INDEX_ENTRY_BYTES, pack_index_keys, unpack_index_keys
from dsuf.gpu.norm import rms_norm
from dsuf.model import quant
from dsuf.model.layers import Compressor, Numerics, Rope, Weights
from dsuf.model.state import CompressorState

EPS = 1e-6  # V4-Flash norm_eps
ROPE = Rope(64, 160000, (16, 65536, 32, 1))  # compressed layers: YaRN on compress_rope_theta
NUM = Numerics()  # reference numerics, bf16 between modules
KINDS = {"csa": (512, 4), "hca": (512, 128), "index": (128, 4)}  # (width, ratio)
MAX_GROUP = 1 << 20  # positions up to V4-Flash's 1M context


class Case:
    """One compressor's weights and a batch's inputs on the device, plus the reference."""

    def __init__(self, kind: str, batch: int, device: torch.device) -> None:
        self.width, self.ratio = KINDS[kind]
        self.overlap = self.ratio == 4
        self.channels = (2 if self.overlap else 1) * self.width
        self.rows = (2 if self.overlap else 1) * self.ratio
        self.batch, self.device = batch, device
        self.channel_scale = torch.exp2(torch.randint(-2, 2, (self.channels,)).float())
        self.ape = torch.randn(self.ratio, self.channels) * 0.5
        self.norm = (1 + 0.2 * torch.randn(self.width)).to(torch.bfloat16).float()
        eye, zero = torch.eye(self.channels), torch.zeros(self.channels, self.channels)
        tensors = {"c.ape": self.ape, "c.wkv.weight": torch.cat((eye, zero), 1), "c.wgate.weight": torch.cat((zero, eye), 1), "c.norm.weight": self.norm}
        self.reference = Compressor(Weights(tensors, SimpleNamespace(norm_eps=EPS)), "c", self.ratio, self.width)  # type: ignore[arg-type]
        self.ape_d, self.norm_d, self.freqs = self.ape.to(device), self.norm.to(device), ROPE.freqs.to(device)
        entry = KV_ENTRY_BYTES if self.width == 512 else INDEX_ENTRY_BYTES
        self.pool = torch.empty((2 * batch, entry), dtype=torch.uint8, device=device)
        self.slots = (torch.randperm(2 * batch, device=device)[:batch]).to(torch.int32 if self.width == 512 else torch.int64)

    def projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        kv = torch.randn(self.batch, self.channels) * self.channel_scale
        return kv.to(self.device), (torch.randn(self.batch, self.channels) * 2).to(self.device)

    def state(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A state that the tokens before each row's position left (padding rows: garbage)."""
        kv = torch.zeros(self.batch, self.rows, self.channels)
        score = torch.full_like(kv, float("-inf"))
        for b, p in enumerate(positions):
            if p < 0:
                kv[b], score[b] = torch.randn(self.rows, self.channels), torch.randn(self.rows, self.channels)
                continue
            cur, phase = (self.ratio if self.overlap else 0), p % self.ratio
            filled = list(range(cur, cur + phase)) + (list(range(self.ratio)) if self.overlap and p >= self.ratio else [])
            kv[b, filled] = torch.randn(len(filled), self.channels) * self.channel_scale
            score[b, filled] = torch.randn(len(filled), self.channels) * 2
        return kv.to(self.device), score.to(self.device)

    def step(self, kv, score, positions, state_kv, state_score, latent=None) -> None:
        compress_decode(kv, score, positions, state_kv, state_score, self.ape_d, self.norm_d, self.freqs, EPS, self.pool, self.slots, latent)

    def pack(self, latent: torch.Tensor) -> torch.Tensor:
        """The reference's cache entries of RoPE'd latents [n, width] (on the device)."""
        if self.width == 512:
            out = torch.empty((latent.shape[0], KV_ENTRY_BYTES), dtype=torch.uint8, device=self.device)
            pack_kv(latent, out)
            return out
        return pack_index_keys(quant.hadamard_transform(latent))


def start_positions(case: Case, steps: int) -> list[int]:
    """Mixed phases and far positions, odd rows completing a group during the run; row 0 starts a
    sequence, row 1 completes the first group at once, row 2 (of 3 or more) is padding throughout."""
    batch, ratio = case.batch, case.ratio
    groups = torch.randint(0, MAX_GROUP // ratio - steps, (batch,)).tolist()
    phases = torch.randint(0, ratio, (batch,)).tolist()
    phases[1::2] = [ratio - 1 - b % min(steps, ratio) for b in range(1, batch, 2)]  # complete during the run
    positions = [g * ratio + ph for g, ph in zip(groups, phases)]
    positions[0] = 0
    if batch > 1:
        positions[1] = ratio - 1
    if batch > 2:
        positions[2] = -1
    return positions


@pytest.mark.parametrize(
    "kind, batch, steps",
    [("csa", 64, 9), ("index", 64, 9), ("hca", 16, 130), ("hca", 64, 4), ("csa", 1, 8), ("index", 3, 8)],
)
def test_compress_decode_against_the_reference(cuda, kind, batch, steps):
    case = Case(kind, batch, cuda)
    positions = start_positions(case, steps)
    state_kv, state_score = case.state(positions)
    ref_states = [CompressorState(state_kv[b].cpu().clone(), state_score[b].cpu().clone()) for b in range(batch)]
    latents, ref_latents, entries, ref_entries = [], [], [], []
    for _ in range(steps):
        kv, score = case.projections()
        projections = torch.cat((kv, score, kv[:, :16]), dim=1)  # a wider matmul output, sliced
        kv, score = projections[:, : case.channels], projections[:, case.channels : 2 * case.channels]
        pos = torch.tensor(positions, dtype=torch.int32, device=cuda)
        case.pool.random_(0, 256)
        pool_before = case.pool.clone()
        padding_before = (state_kv[pos < 0].clone(), state_score[pos < 0].clone())
        latent = torch.full((batch, case.width), float("nan"), dtype=torch.bfloat16, device=cuda)
        case.step(kv, score, pos, state_kv, state_score, latent)

        done = []
        x = torch.cat((kv, score), dim=1).cpu()
        for b, p in enumerate(positions):
            if p < 0:
                continue
            out, entry_pos = case.reference(x[b : b + 1], p, ref_states[b], NUM)
            assert out.shape[0] == int((p + 1) % case.ratio == 0)
            if out.shape[0]:
                ref_latents.append(ROPE.apply(out, ROPE.cos_sin(entry_pos))[0])
                done.append(b)
        got_kv, got_score = state_kv.cpu(), state_score.cpu()
        for b, p in enumerate(positions):
            if p >= 0:
                assert torch.equal(got_kv[b], ref_states[b].kv) and torch.equal(got_score[b], ref_states[b].score), f"state of row {b} at position {p}"
        assert torch.equal(state_kv[pos < 0], padding_before[0]) and torch.equal(state_score[pos < 0], padding_before[1]), "a padding row's state changed"

        rows = case.slots.long()[done]
        written = torch.zeros(case.pool.shape[0], dtype=torch.bool, device=cuda)
        written[rows] = True
        assert torch.equal(case.pool[~written], pool_before[~written]), "wrote an entry no completed group makes"
        latents += list(latent[done].float())
        entries.append(case.pool[rows])
        if done:
            ref_entries.append(case.pack(torch.stack(ref_latents[-len(done) :]).to(cuda)))
        positions = [p + 1 if p >= 0 else p for p in positions]

    got, ref = torch.stack(latents), torch.stack(ref_latents).to(cuda)
    rel, worst = compare(f"{kind} B={batch}: {got.shape[0]} entries after RoPE", got, ref.float())
    exact = float((got == ref.float()).float().mean())
    entries_t, ref_entries_t = torch.cat(entries), torch.cat(ref_entries)
    same = (entries_t == ref_entries_t).all(dim=1)
    if case.width == 512:
        values, ref_values = got, ref.float()  # the entry holds the bf16 row (FP8 on the nope dims)
    else:
        values, ref_values = unpack_index_keys(entries_t), unpack_index_keys(ref_entries_t)
    print(f"  {kind} B={batch}: latents {exact:.6f} bit-exact, entries {int(same.sum())}/{same.numel()} byte-equal, "
          f"entry values rel err {float((values - ref_values).norm() / ref_values.norm()):.2e}")
    assert worst <= 1.0 and rel < 1e-4 and exact > 0.999
    assert float(same.float().mean()) >= (1.0 if exact == 1.0 and case.width == 512 else 0.95)


def test_compress_decode_in_a_cuda_graph(cuda):
    """The three compressors captured once in one graph, replayed with new positions (completing,
    not, padding) written into the same tensors: the same results as eager calls."""
    batch = 8
    cases = [Case(kind, batch, cuda) for kind in KINDS]
    ratio_of = [c.ratio for c in cases]

    def inputs(case: Case, positions: list[int]) -> list[torch.Tensor]:
        kv, score = case.projections()
        pos = torch.tensor(positions, dtype=torch.int32, device=cuda)
        latent = torch.zeros((batch, case.width), dtype=torch.bfloat16, device=cuda)
        return [kv, score, pos, *case.state(positions), latent]

    def positions_for(ratio: int) -> list[int]:
        p = [g * ratio + ph for g, ph in zip(torch.randint(0, 4096, (batch,)).tolist(), torch.randint(0, ratio, (batch,)).tolist())]
        p[0], p[1], p[2] = -1, ratio - 1, 7 * ratio - 1
        return p

    static = [inputs(c, positions_for(c.ratio)) for c in cases]
    for c, args in zip(cases, static):
        c.step(*args)  # outside the capture first: loads the kernel
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c, args in zip(cases, static):
            c.step(*args)
    for trial in range(4):
        fresh = [inputs(c, positions_for(r) if trial < 3 else [-1] * batch) for c, r in zip(cases, ratio_of)]
        eager = []
        for c, args, new in zip(cases, static, fresh):
            for s, n in zip(args, new):
                s.copy_(n)
            c.pool.random_(0, 256)
            eager.append((c.pool.clone(), [n.clone() for n in new]))
        graph.replay()
        for c, args, (pool, new) in zip(cases, static, eager):
            graph_pool = c.pool.clone()
            c.pool.copy_(pool)
            c.step(*new)
            assert torch.equal(graph_pool, c.pool), f"trial {trial}: pool of the {c.width}/{c.ratio} compressor"
            for s, n in zip(args, new):
                assert torch.equal(s, n), f"trial {trial}: the graph and the eager call differ"


def _torch_pool(kv, score, st_kv, st_score, ratio: int, width: int) -> torch.Tensor:
    """The torch pooling this kernel replaces (dsuf.gpu.bench, at the group-completing token)."""
    if ratio == 4:
        pool_kv = torch.cat((st_kv[:, :4, :width], st_kv[:, 4:7, width:], kv[:, None, width:]), dim=1)
        pool_score = torch.cat((st_score[:, :4, :width], st_score[:, 4:7, width:], score[:, None, width:]), dim=1)
    else:
        pool_kv = torch.cat((st_kv[:, : ratio - 1], kv[:, None]), dim=1)
        pool_score = torch.cat((st_score[:, : ratio - 1], score[:, None]), dim=1)
    kv64, score64 = pool_kv.double().transpose(1, 2), pool_score.double().transpose(1, 2)
    return (kv64 * score64.softmax(dim=-1)).sum(dim=-1).float().to(torch.bfloat16)


def _graph_us(step, reps: int = 10, replays: int = 50) -> float:
    """Microseconds per step of a CUDA graph of `reps` steps (no launch overhead per step)."""
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * reps)


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_compress_decode_timing(cuda, batch):
    """Prints the step's time in a CUDA graph: CSA (main + indexer compressors) and HCA, at a
    group-completing token and at one that only joins its group, against the torch pooling + norm
    + RoPE + packing kernels it replaces (no state update there)."""
    cases = {kind: Case(kind, batch, cuda) for kind in KINDS}
    for completing in (True, False):
        args = {}
        for kind, c in cases.items():
            groups = torch.randint(1, 4096, (batch,))
            pos = (groups * c.ratio + (c.ratio - 1 if completing else 1)).to(torch.int32)
            kv, score = c.projections()
            args[kind] = (kv, score, pos.to(cuda), *c.state(pos.tolist()))

        times = {
            "CSA": _graph_us(lambda a=args: (cases["csa"].step(*a["csa"]), cases["index"].step(*a["index"]))),
            "HCA": _graph_us(lambda a=args: cases["hca"].step(*a["hca"])),
        }
        line = ", ".join(f"{k} {v:.1f} us" for k, v in times.items())
        print(f"  compress_decode B={batch}, {'completing' if completing else 'joining'} token: {line}")

    cos, sin = (t.to(cuda) for t in ROPE.cos_sin(torch.full((batch,), 4096 * 4)))

    def torch_stage(kind: str, c: Case, index: bool = False) -> None:
        kv, score, _, st_kv, st_score = args[kind]
        latent = rms_norm(_torch_pool(kv, score + c.ape_d[c.ratio - 1], st_kv, st_score, c.ratio, c.width), c.norm_d, EPS)
        latent = ROPE.apply(latent.view(batch, 1, c.width), (cos, sin)).view(batch, c.width)
        if index:
            pack_index_keys(quant.hadamard_transform(latent), c.pool, c.slots)
        else:
            pack_kv(latent, c.pool, c.slots)

    old = {
        "CSA": _graph_us(lambda: (torch_stage("csa", cases["csa"]), torch_stage("index", cases["index"], True))),
        "HCA": _graph_us(lambda: torch_stage("hca", cases["hca"])),
    }
    print(f"  torch pooling + kernels B={batch}: " + ", ".join(f"{k} {v:.1f} us" for k, v in old.items()))


@pytest.mark.parametrize("parallel", [False, True], ids=["a cluster a row", "groups in parallel"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_state_rows_address_the_states_of_many_sequences(cuda, kind, parallel):
    """With state_rows, row b works on state[state_rows[b]] of a larger state (the GPU model's
    per-slot states): the same as working on those rows gathered, and no other row touched;
    with the groups in parallel too."""
    batch, held = 6, 11
    case = Case(kind, batch, cuda)
    rows = torch.randperm(held, device=cuda)[:batch]
    positions = [case.ratio - 1, 0, 2 * case.ratio - 1, case.ratio + 1, 3, 5 * case.ratio - 1]
    pos = torch.tensor(positions, dtype=torch.int32, device=cuda)
    many_kv, many_score = torch.randn(held, case.rows, case.channels, device=cuda), torch.randn(held, case.rows, case.channels, device=cuda)
    many_kv[rows], many_score[rows] = case.state(positions)
    gathered_kv, gathered_score = many_kv[rows].clone(), many_score[rows].clone()
    before_kv, before_score = many_kv.clone(), many_score.clone()
    kv, score = case.projections()
    case.step(kv, score, pos, gathered_kv, gathered_score)
    expected = case.pool.clone()
    compress_decode(kv, score, pos, many_kv, many_score, case.ape_d, case.norm_d, case.freqs, EPS, case.pool, case.slots, state_rows=rows,
                    groups_in_parallel=parallel)
    assert torch.equal(many_kv[rows], gathered_kv) and torch.equal(many_score[rows], gathered_score)
    others = torch.ones(held, dtype=torch.bool, device=cuda)
    others[rows] = False
    assert torch.equal(many_kv[others], before_kv[others]) and torch.equal(many_score[others], before_score[others])
    assert torch.equal(case.pool, expected)


@pytest.mark.parametrize("parallel", [False, True], ids=["runs", "groups in parallel"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_runs_apply_the_tokens_of_one_sequence_in_order(cuda, kind, parallel):
    """A prefill chunk in one launch: rows of one sequence at consecutive positions share its state
    (state_rows), and runs make the kernel apply them one after another; or, with the groups in
    parallel, each group is pooled from the rows and the state before them at once. The state and
    every entry written equal the same tokens fed one launch at a time. Padding rows as the GPU
    model's steps have them (a scratch state row, position 0, a run each) and one at position -1
    (its state row untouched) change nothing else."""
    case = Case(kind, 1, cuda)
    lengths, starts = [2 * case.ratio + 3, 5], [case.ratio - 2, 0]  # runs crossing group boundaries, and a short one
    real = sum(lengths)
    rows = real + 4
    state_rows = torch.tensor([1] * lengths[0] + [3] * lengths[1] + [0, 0, 0, 2], device=cuda)
    pos = torch.tensor([p for start, n in zip(starts, lengths) for p in range(start, start + n)] + [0, 0, 0, -1], dtype=torch.int32, device=cuda)
    runs = torch.tensor([0, lengths[0], *range(real, rows + 1)], dtype=torch.int32, device=cuda)
    kv = torch.randn(rows, case.channels, device=cuda) * case.channel_scale.to(cuda)
    score = torch.randn(rows, case.channels, device=cuda) * 2
    state_kv, state_score = torch.zeros(4, case.rows, case.channels, device=cuda), torch.full((4, case.rows, case.channels), float("-inf"), device=cuda)
    for r, (start, _) in enumerate(zip(starts, lengths)):  # the states the tokens before each run left
        s_kv, s_score = case.state([start])
        state_kv[1 + 2 * r], state_score[1 + 2 * r] = s_kv[0], s_score[0]
    state_kv[2], state_score[2] = torch.randn(case.rows, case.channels, device=cuda), torch.randn(case.rows, case.channels, device=cuda)
    entry = case.pool.shape[1]
    slots = torch.arange(rows, device=cuda).to(case.slots.dtype)
    one_kv, one_score, one_pool = state_kv.clone(), state_score.clone(), torch.zeros((rows, entry), dtype=torch.uint8, device=cuda)
    for b in range(rows):
        compress_decode(kv[b : b + 1], score[b : b + 1], pos[b : b + 1], one_kv, one_score, case.ape_d, case.norm_d, case.freqs, EPS, one_pool,
                        slots[b : b + 1], state_rows=state_rows[b : b + 1])
    pool = torch.zeros_like(one_pool)
    compress_decode(kv, score, pos, state_kv, state_score, case.ape_d, case.norm_d, case.freqs, EPS, pool, slots, state_rows=state_rows, runs=runs,
                    groups_in_parallel=parallel)
    assert torch.equal(state_kv[1:], one_kv[1:]) and torch.equal(state_score[1:], one_score[1:])  # (row 0: the padding's scratch)
    assert torch.equal(pool, one_pool)
    assert int((pool != 0).any(dim=1).sum()) == sum((start + n) // case.ratio - start // case.ratio for start, n in zip(starts, lengths))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("start, rows", [(0, 1), (1, 2), (0, 700), (3, 514), (130, 397)])
def test_a_chunk_compressed_group_by_group_equals_its_rows_in_order(cuda, kind, start, rows):
    """compress_chunk (a long prompt chunk's groups in parallel, each from the state its earlier
    rows leave) writes the same entries and leaves the same state, bit for bit, as the chunk's rows
    applied in order in one run; other slots' states are untouched."""
    case = Case(kind, 1, cuda)
    slot = torch.tensor([2], device=cuda)
    state_kv, state_score = torch.randn(4, case.rows, case.channels, device=cuda), torch.randn(4, case.rows, case.channels, device=cuda)
    s_kv, s_score = case.state([start])  # what the tokens before the chunk left
    state_kv[2], state_score[2] = s_kv[0], s_score[0]
    kv = torch.randn(rows, case.channels, device=cuda) * case.channel_scale.to(cuda)
    score = torch.randn(rows, case.channels, device=cuda) * 2
    pos = torch.arange(start, start + rows, dtype=torch.int32, device=cuda)
    entries = (start + rows) // case.ratio + 1
    dst = (pos.long() // case.ratio).to(case.slots.dtype)
    in_order_kv, in_order_score = state_kv.clone(), state_score.clone()
    in_order = torch.zeros((entries, case.pool.shape[1]), dtype=torch.uint8, device=cuda)
    compress_decode(kv, score, pos, in_order_kv, in_order_score, case.ape_d, case.norm_d, case.freqs, EPS, in_order, dst,
                    state_rows=slot.repeat(rows), runs=torch.tensor([0, rows], dtype=torch.int32, device=cuda))
    pool = torch.zeros_like(in_order)
    compress_chunk(kv, score, start, state_kv, state_score, slot, case.ape_d, case.norm_d, case.freqs, EPS, pool, dst)
    assert torch.equal(pool, in_order)
    assert torch.equal(state_kv, in_order_kv) and torch.equal(state_score, in_order_score)
    assert int((pool != 0).any(dim=1).sum()) == (start + rows) // case.ratio - start // case.ratio
