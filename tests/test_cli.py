"""The command line run as real processes: `dsuf make-tiny`, `dsuf logits`, `dsuf generate`, and what
`dsuf serve` and `dsuf bench` refuse before they start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch


def dsuf(*args: str, ok: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "dsuf", *args], capture_output=True, text=True, timeout=300,
                          env=None if env is None else {**os.environ, **env})
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    proc = dsuf("make-tiny", "--family", "v4", "--out", str(out), "--seed", "4", "--set", "vocab_size=300", "--set", "index_topk=2")
    assert "['swa', 'swa', 'csa', 'hca', 'csa', 'hca']" in proc.stdout
    return out


def test_make_tiny_writes_the_released_layout(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    assert config["vocab_size"] == 300 and config["index_topk"] == 2
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert (ckpt / "inference" / "config.json").is_file()
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert "layers.2.attn.indexer.wq_b.scale" in index["weight_map"]
    assert len(set(index["weight_map"].values())) > 1  # sharded


def test_logits_modes_agree_and_have_the_documented_shape(ckpt, tmp_path):
    tokens = ",".join(str(t) for t in range(3, 3 + 19))
    results = {}
    for mode in ("prefill", "chunked", "decode"):
        out = tmp_path / f"{mode}.npy"
        dsuf("logits", "--ckpt", str(ckpt), "--tokens", tokens, "--mode", mode, "--chunk", "5",
             "--numerics", "exact", "--dtype", "float32", "--out", str(out))
        results[mode] = np.load(out)
        assert results[mode].shape == (19, 300) and results[mode].dtype == np.float32
    for mode in ("chunked", "decode"):
        err = np.linalg.norm(results[mode] - results["prefill"]) / np.linalg.norm(results["prefill"])
        assert err < 1e-5


def test_generate_prints_greedy_token_ids(ckpt, tmp_path):
    proc = dsuf("generate", "--ckpt", str(ckpt), "--tokens", "5,6,7", "--max-new", "6", "--numerics", "exact")
    ids = [int(t) for t in proc.stdout.strip().split(",")]
    assert 1 <= len(ids) <= 6 and all(0 <= t < 300 for t in ids)
    # greedy is the argmax of the logits CLI's last position, fed back
    out = tmp_path / "l.npy"
    dsuf("logits", "--ckpt", str(ckpt), "--tokens", "5,6,7", "--numerics", "exact", "--out", str(out))
    assert ids[0] == int(np.load(out)[-1].argmax())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tokens", "1,x"], "comma-separated integers"),
        (["--tokens", "1,300"], "outside the vocabulary"),
    ],
)
def test_bad_input_gets_a_one_line_error(ckpt, tmp_path, args, message):
    proc = dsuf("logits", "--ckpt", str(ckpt), *args, "--out", str(tmp_path / "x.npy"), ok=False)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_missing_checkpoint_and_bad_override_are_reported_plainly(tmp_path):
    proc = dsuf("generate", "--ckpt", str(tmp_path / "nowhere"), "--tokens", "1", ok=False)
    assert proc.returncode == 2 and "no config.json" in proc.stderr and "Traceback" not in proc.stderr
    proc = dsuf("make-tiny", "--out", str(tmp_path / "t"), "--set", "num_key_value_heads=2", ok=False)
    assert proc.returncode == 2 and "num_key_value_heads" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "0,0"], "distinct GPU ids"),
        (["--gpus", "0,1,2", "--random-weights", "v4-flash.json"], "random-v4-flash cannot be split over 3 GPUs: the ranks must be 1, 2, 4 or 8"),
        (["--gpus", "zero"], "comma-separated GPU ids"),
        (["--random-weights", "config.json"], "--random-weights runs on the GPU path: add --gpus"),
        (["--gpus", "0", "--random-weights", "config.json", "--ckpt", "x"], "not both"),
        (["--gpus", "0", "--random-weights", "nowhere.json"], "--random-weights nowhere.json"),
        pytest.param(["--gpus", "0", "--random-weights", "v4-flash.json"], "dsuf: --gpus 0 names GPU 0, but torch sees no GPU (",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")),
        (["--device", "tpu"], "unknown --device"),
        (["--gpus", "0"], "the GPU path runs V4-Flash's layer shapes; "),  # the embedded tiny model's are smaller
        (["--max-model-len", "2000000"], "--max-model-len 2000000 exceeds dsuf-tiny-v4-seed0's context of 1048576 tokens"),
    ],
)
def test_serve_refuses_options_it_cannot_honour_in_one_line(args, message, tmp_path):
    from dsuf.gpu.weights import V4_FLASH_CONFIG

    (tmp_path / "v4-flash.json").write_text(json.dumps(V4_FLASH_CONFIG))
    proc = subprocess.run([sys.executable, "-m", "dsuf", "serve", "--port", "0", "--kv-host-bytes", "0", *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--port", "99999"], {}, "argument --port: must be in 0..65535, got 99999"),  # uvloop would listen on 34463
        (["--kv-port", "-1"], {}, "argument --kv-port: must be in 0..65535, got -1"),
        ([], {"DSUF_PORT": "http"}, "argument --port: invalid int value: 'http'"),
        ([], {"DSUF_MAX_BATCH": "many"}, "argument --max-batch: invalid int value: 'many'"),
        (["--max-batch", "0"], {}, "argument --max-batch: must be at least 1, got 0"),  # no request would ever run
        (["--numerics", "bogus"], {}, "argument --numerics: invalid choice: 'bogus' (choose from 'reference', 'exact')"),  # the worker died of it
        (["--kv-fetch-timeout", "0"], {}, "argument --kv-fetch-timeout: must be at least 0.001, got 0"),
        (["--step-timeout", "inf"], {}, "argument --step-timeout: must be in 0..1000000.0, got inf"),
    ],
)
def test_serve_refuses_a_bad_option_or_environment_value_in_one_line(args, env, message):
    proc = dsuf("serve", *args, ok=False, env=env)
    assert proc.returncode == 2 and proc.stderr.strip() == f"dsuf serve: error: {message}"


def test_a_bad_serve_environment_value_breaks_no_other_command(ckpt):
    proc = dsuf("generate", "--ckpt", str(ckpt), "--tokens", "5,6", "--max-new", "1", env={"DSUF_PORT": "http"})
    assert len(proc.stdout.strip().split(",")) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--context", "100"], "contexts must be multiples of 128 of at least 256, got 100"),
        (["--max-context", "8192"], "--max-context sizes the whole model's caches: add --model"),
        (["--model", "--max-context", "4096", "--context", "8192"], "--max-context must be a multiple of 128 that holds every context, got 4096"),
        (["--model", "--max-context", "65600"], "--max-context must be a multiple of 128"),
        (["--tp", "2"], "--tp runs the whole model: add --model"),
        (["--shard-of", "2"], "--shard-of times one rank of the whole model on one GPU: add --model, without --tp"),
        (["--model", "--shard-of", "2", "--tp", "2"], "add --model, without --tp"),
        (["--model", "--shard-of", "3"], "cannot be split over 3 GPUs: the ranks must be 1, 2, 4 or 8"),
    ],
)
def test_bench_refuses_bad_arguments_in_one_line_before_looking_for_a_gpu(args, message):
    proc = dsuf("bench", *args, ok=False)
    assert proc.returncode != 0 and proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("dsuf bench: ") and message in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_bench_takes_good_arguments_and_then_says_plainly_that_it_needs_a_gpu():
    proc = dsuf("bench", "--model", "--shard-of", "2", "--max-context", "8192", "--context", "4096", "8192", ok=False)
    assert proc.returncode == 2 and proc.stderr.strip() == "dsuf bench: no CUDA device"
