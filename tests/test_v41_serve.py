"""`dsuf serve` serves a tiny DeepSeek-V4.1-Flash checkpoint through the OpenAI API, thinking on
and off, with its own tokenizer (V4.1's special tokens) and its conversation caches."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_fixture import Server, http, server_env  # noqa: E402
from test_server import cache_home  # noqa: E402, F401

from dsuf.model.tiny import make_tiny  # noqa: E402


@pytest.fixture(scope="module")
def v41_ckpt(tmp_path_factory) -> Path:
    """A tiny V4.1 checkpoint with the full vocabulary, so every prompt id of its tokenizer fits."""
    path = tmp_path_factory.mktemp("v41") / "tiny-v41"
    make_tiny(path, family="v41", seed=3)
    return path


@pytest.fixture(scope="module")
def v41_server(v41_ckpt, cache_home, tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("v41-log") / "v41.log", ["--ckpt", str(v41_ckpt), "--max-model-len", "1024"],
                    server_env(cache_home))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def ask(server: Server, messages: list[dict], thinking: bool) -> dict:
    body = {"model": "deepseek-v4.1-flash", "messages": messages, "max_tokens": 6, "temperature": 0, "seed": 7,
            "thinking": {"type": "enabled" if thinking else "disabled"}}
    status, _, raw = http("POST", server.url + "/v1/chat/completions", body)
    assert status == 200, raw
    return json.loads(raw)


@pytest.mark.parametrize("thinking", [False, True])
def test_a_v41_checkpoint_answers_with_thinking_on_and_off(v41_server, thinking):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    first = ask(v41_server, messages, thinking)
    usage = first["usage"]
    assert usage["completion_tokens"] > 0 and first["choices"][0]["finish_reason"] in ("stop", "length")
    again = ask(v41_server, messages, thinking)
    assert again["usage"]["prompt_cache_hit_tokens"] == usage["prompt_tokens"] - 1  # V4.1 snapshots work too
    assert again["choices"] == first["choices"]
    assert "family v41" in v41_server.log()


def test_a_v41_checkpoint_without_its_tokenizer_is_refused_at_start(v41_ckpt, cache_home, tmp_path):
    ckpt = tmp_path / "no-tokenizer"
    shutil.copytree(v41_ckpt, ckpt)
    (ckpt / "tokenizer.json").unlink()
    server = Server(tmp_path / "s.log", ["--ckpt", str(ckpt)], server_env(cache_home))
    assert server.proc.wait(120) != 0
    assert "needs its own" in server.log()


def test_a_tokenizer_beyond_the_checkpoint_vocabulary_is_refused_at_start(tiny_v41, cache_home, tmp_path):
    small = tiny_v41("default")  # a 512-token vocabulary, served with the full V4.1 tokenizer
    server = Server(tmp_path / "s.log", ["--ckpt", str(small)], server_env(cache_home))
    assert server.proc.wait(120) != 0
    assert "beyond the checkpoint's vocabulary of 512" in server.log()
