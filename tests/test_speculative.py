"""Speculative greedy decoding with the MTP layer (dsuf.model.speculative) on the reference path:
exactly greedy decoding's tokens, whether drafts are accepted or rejected, and the drafts' tally."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_server import cache_home  # noqa: E402, F401

from dsuf.cli import greedy, speculative_greedy
from dsuf.model import load_model
from dsuf.model.layers import Numerics

EXACT = Numerics("exact", torch.float32)
PROMPT = torch.tensor([5, 17, 300, 42, 9, 120, 77, 3, 250, 64, 31, 8])


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir("default"))


def test_mtp_drafts_give_greedy_decoding(model):
    want = greedy(model, PROMPT, 24, EXACT)
    got = speculative_greedy(model, PROMPT, 24, EXACT)
    assert got.tokens == want and 0 < got.drafted < len(want)
    print(f"\n  MTP drafts accepted: {got.accepted} of {got.drafted} (random weights)")


@pytest.mark.parametrize("oracle", ["always right", "always wrong"])
def test_accepted_and_rejected_drafts_both_keep_greedy_tokens(model, monkeypatch, oracle):
    """Drafts from an oracle that knows greedy's answer (every draft accepted: two tokens a step)
    or gets it wrong on purpose (every draft rejected: the state is taken back each step)."""
    want = greedy(model, PROMPT, 20, EXACT)
    real = model.mtp_forward

    def drafts(streams, next_tokens, start, state, num, depth=0):
        logits = real(streams, next_tokens, start, state, num, depth)  # the MTP state advances as it would
        right = want[start + next_tokens.shape[0] + 1 - PROMPT.shape[0]] if start + next_tokens.shape[0] + 1 - PROMPT.shape[0] < len(want) else 0
        logits = torch.zeros_like(logits)
        logits[-1, right if oracle == "always right" else (right + 1) % logits.shape[1]] = 1.0
        return logits

    monkeypatch.setattr(model, "mtp_forward", drafts)
    got = speculative_greedy(model, PROMPT, 20, EXACT)
    assert got.tokens == want
    if oracle == "always right":
        assert got.accepted == got.drafted and got.drafted <= (len(want) + 1) // 2
    else:
        assert got.accepted == 0 and got.drafted == len(want) - 1


def test_a_draft_needs_only_the_last_window_of_rows(model):
    """The Drafter feeds the MTP layer a long feed's last `window` rows only (a window-only block
    whose cache rows depend on their own input alone): the same draft, and the same MTP window,
    as feeding it every row."""
    import copy

    from dsuf.model.speculative import Drafter

    w = model.config.window_size
    tokens = torch.randint(0, model.config.vocab_size, (3 * w + 1,))
    state = model.new_state(EXACT)
    logits, streams = model.forward(tokens, state, EXACT, return_streams=True)
    chosen = int(logits[-1].argmax())
    every = copy.deepcopy(state)
    want = int(model.mtp_forward(streams, torch.tensor(tokens[1:].tolist() + [chosen]), 0, every, EXACT)[-1].argmax())
    got = Drafter(model, EXACT).fed(streams, 0, tokens.tolist(), state, [torch.tensor([chosen])])
    assert int(got) == want and torch.equal(state.mtp[0].window, every.mtp[0].window)


def test_taking_a_draft_back_keeps_the_mtp_layers_state(model):
    """The worker drafts the next token before it takes a rejected draft's row back (the MTP
    layer never saw that row): take_back restores the main model's state, not the MTP layer's."""
    state = model.new_state(EXACT)
    logits, streams = model.forward(PROMPT, state, EXACT, return_streams=True)
    chosen = int(logits[-1].argmax())
    (v,) = model.verify_batch([(torch.tensor([chosen]), state, (chosen + 1) % model.config.vocab_size)], EXACT)
    model.mtp_forward(v.streams[:1], torch.tensor([chosen]), PROMPT.shape[0], state, EXACT)  # the next draft, from the kept row
    drafted = state.mtp[0].window.clone()
    back = model.take_back(state, v.undo)
    assert back.pos == PROMPT.shape[0] + 1 and torch.equal(back.mtp[0].window, drafted)


@pytest.mark.parametrize("lookahead", [False, True])
def test_every_rank_speculates_alike_and_only_the_leader_reports(model, lookahead):
    """The ranks of a tensor-parallel model each run the speculative step (their MTP layers meet in
    collectives): a rank that is not the leader makes the same choices (and looks ahead alike)
    and reports none."""
    from dsuf.ipc.messages import SeqWork, Step
    from dsuf.worker.main import Worker
    from dsuf.worker.sampling import SamplingParams

    leader, other = (Worker(model, EXACT, "", leader=rank == 0, speculative=True, lookahead=lookahead) for rank in (0, 1))
    work = SeqWork(1, PROMPT.tolist(), sample=True, params=SamplingParams(temperature=0.8, seed=3))
    for step in range(1, 12):
        (mine,), (theirs,) = (w.run_step(Step(step, [work])).outputs for w in (leader, other))
        assert mine.choice is not None and theirs.choice is None and theirs.more == [] and theirs.error is None
        assert leader.states[1].pos == other.states[1].pos and {k: int(d) for k, d in leader.drafts.items()} == {k: int(d) for k, d in other.drafts.items()}
        assert (1 in leader.ahead) == (1 in other.ahead) == lookahead
        if lookahead:
            assert leader.ahead[1].token == other.ahead[1].token == (mine.more or [mine.choice])[-1].token
        work = SeqWork(1, [(mine.more or [mine.choice])[-1].token], sample=True)


def test_generate_speculative_prints_greedy_tokens_and_the_acceptance(tiny_dir):
    ckpt = str(tiny_dir("default"))
    args = ["--ckpt", ckpt, "--tokens", ",".join(map(str, PROMPT.tolist())), "--max-new", "8", "--numerics", "exact"]
    plain = subprocess.run([sys.executable, "-m", "dsuf", "generate", *args], capture_output=True, text=True, check=True)
    spec = subprocess.run([sys.executable, "-m", "dsuf", "generate", *args, "--speculative"], capture_output=True, text=True, check=True)
    assert spec.stdout == plain.stdout
    assert "MTP drafts accepted:" in spec.stderr


def test_a_model_without_an_mtp_layer_is_refused(tmp_path):
    from dsuf.model.tiny import make_tiny

    make_tiny(tmp_path / "no-mtp", family="v4", seed=1, overrides={"vocab_size": 512, "num_nextn_predict_layers": 0})
    proc = subprocess.run([sys.executable, "-m", "dsuf", "generate", "--ckpt", str(tmp_path / "no-mtp"), "--tokens", "1,2", "--speculative"],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "MTP layer" in proc.stderr and "Traceback" not in proc.stderr


def test_dsuf_serve_speculative_answers_as_without_drafts(tmp_path, cache_home):
    """The embedded tiny model served with --speculative: a greedy and a seeded sampled answer,
    then the greedy request again (its prompt from the conversation cache), equal a plain server's."""
    import json

    from server_fixture import Server, http, server_env

    def answers(server: Server) -> list:
        out = []
        for body in ({"temperature": 0, "max_tokens": 12}, {"temperature": 0.9, "seed": 5, "max_tokens": 12}):
            body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "Name three colours."}], **body}
            status, _, raw = http("POST", server.url + "/v1/chat/completions", body)
            assert status == 200, raw
            reply = json.loads(raw)
            out.append((reply["choices"][0]["message"], reply["choices"][0]["finish_reason"], reply["usage"]["completion_tokens"]))
        again = http("POST", server.url + "/v1/chat/completions", {"model": "deepseek-chat", "max_tokens": 12, "temperature": 0,
                                                                   "messages": [{"role": "user", "content": "Name three colours."}]})
        out.append((json.loads(again[2])["choices"][0]["message"], json.loads(again[2])["usage"].get("prompt_cache_hit_tokens")))
        return out

    got = {}
    for name, extra in (("plain", []), ("speculative", ["--speculative"])):
        server = Server(tmp_path / f"{name}.log", extra, server_env(cache_home))
        try:
            server.wait_ready()
            got[name] = answers(server)
        finally:
            server.stop()
    assert got["speculative"] == got["plain"]


def test_dsuf_serve_speculative_refuses_a_model_without_an_mtp_layer(tmp_path, cache_home):
    from dsuf.model.tiny import make_tiny
    from server_fixture import REPO, server_env

    make_tiny(tmp_path / "no-mtp", family="v4", seed=1, overrides={"num_nextn_predict_layers": 0})
    proc = subprocess.run([sys.executable, "-m", "dsuf", "serve", "--ckpt", str(tmp_path / "no-mtp"), "--speculative", "--port", "1"],
                          capture_output=True, text=True, cwd=REPO, env=server_env(cache_home), timeout=120)
    assert proc.returncode != 0 and "MTP layer" in proc.stderr and "Traceback" not in proc.stderr
