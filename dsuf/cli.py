"""The `dsuf` command line."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch


def _tokens(text: str) -> torch.Tensor:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise SystemExit(f"dsuf: --tokens expects comma-separated integers, got {text!r}") from None
    if not ids:
        raise SystemExit("dsuf: --tokens is empty")
    return torch.tensor(ids, dtype=torch.int64)


def _check_vocab(tokens: torch.Tensor, vocab: int) -> None:
    bad = tokens[(tokens < 0) | (tokens >= vocab)]
    if bad.numel():
        raise SystemExit(f"dsuf: token id {int(bad[0])} is outside the vocabulary [0, {vocab})")


def run_logits(model, tokens: torch.Tensor, mode: str, chunk: int, num) -> torch.Tensor:
    """Logits of every position, computed by prefill in one piece, in chunks, or token by token."""
    state = model.new_state(num)
    step = {"prefill": tokens.shape[0], "chunked": chunk, "decode": 1}[mode]
    return torch.cat([model.forward(tokens[i : i + step], state, num) for i in range(0, tokens.shape[0], step)])


def cmd_make_tiny(args: argparse.Namespace) -> None:
    from dsuf.model.tiny import make_tiny, parse_overrides

    config = make_tiny(args.out, family=args.family, seed=args.seed, overrides=parse_overrides(args.set), plain=args.plain)
    kinds = [config.layer_kind(i) for i in range(config.n_layers)]
    print(f"wrote {args.out}: {config.n_layers} layers {kinds}, vocab {config.vocab_size}, dim {config.dim}")


def cmd_logits(args: argparse.Namespace) -> None:
    from dsuf.model import load_model
    from dsuf.model.layers import Numerics

    num = Numerics.parse(args.numerics, args.dtype)
    model = load_model(args.ckpt)
    tokens = _tokens(args.tokens)
    _check_vocab(tokens, model.config.vocab_size)
    if args.chunk < 1:
        raise SystemExit("dsuf: --chunk must be at least 1")
    began = time.perf_counter()
    logits = run_logits(model, tokens, args.mode, args.chunk, num)
    elapsed = time.perf_counter() - began
    np.save(args.out, logits.float().numpy())
    print(f"wrote {args.out}: logits [{logits.shape[0]}, {logits.shape[1]}] ({args.mode}, {args.numerics}, {elapsed:.3f} s)")


def greedy(model, prompt: torch.Tensor, max_new: int, num) -> list[int]:
    """Greedy decoding: prefill the prompt, then feed back the argmax one token at a time."""
    state = model.new_state(num)
    logits = model.forward(prompt, state, num)
    out: list[int] = []
    for _ in range(max_new):
        token = int(logits[-1].argmax())
        out.append(token)
        if token == model.config.eos_token_id:
            break
        logits = model.forward(torch.tensor([token]), state, num)
    return out


@dataclass
class Speculated:
    tokens: list[int]
    drafted: int  # steps that verified a draft (every decode step of a speculating worker)
    accepted: int  # drafts that were the main model's own choice

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def speculative_greedy(model, prompt: torch.Tensor, max_new: int, num) -> Speculated:
    """greedy() through the server's speculative worker step (MTP drafts, dsuf.model.speculative):
    up to max_new tokens after `prompt`, stopping after EOS. ValueError without an MTP layer."""
    from dsuf.ipc.messages import SeqWork, Step
    from dsuf.worker.main import Worker
    from dsuf.worker.sampling import SamplingParams

    worker = Worker(model, num, "", speculative=True)
    eos = model.config.eos_token_id
    work = SeqWork(1, prompt.tolist(), sample=True, params=SamplingParams(temperature=0.0))
    out: list[int] = []
    drafted = accepted = step = 0
    while True:
        step += 1
        (result,) = worker.run_step(Step(step, [work])).outputs
        if result.error is not None:
            raise RuntimeError(result.error)
        chosen = [c.token for c in (result.choice, *result.more)]  # all but the last fed already
        if step > 1:
            drafted, accepted = drafted + 1, accepted + len(chosen) - 1
        for t in chosen:
            if len(out) < max_new and (not out or out[-1] != eos):
                out.append(t)
        if len(out) >= max_new or out[-1] == eos:
            return Speculated(out, drafted, accepted)
        work = SeqWork(1, chosen[-1:], sample=True)


def cmd_generate(args: argparse.Namespace) -> None:
    from dsuf.model import load_model
    from dsuf.model.layers import Numerics

    num = Numerics.parse(args.numerics, args.dtype)
    model = load_model(args.ckpt)
    tokens = _tokens(args.tokens)
    _check_vocab(tokens, model.config.vocab_size)
    if not args.speculative:
        print(",".join(str(t) for t in greedy(model, tokens, args.max_new, num)))
        return
    try:
        result = speculative_greedy(model, tokens, args.max_new, num)
    except ValueError as exc:
        raise SystemExit(f"dsuf generate: {exc}") from None
    print(",".join(str(t) for t in result.tokens))
    print(f"MTP drafts accepted: {result.accepted} of {result.drafted} ({100 * result.acceptance:.0f} %)", file=sys.stderr)


def cmd_serve(args: argparse.Namespace) -> None:
    from dsuf.serve import main as serve_main

    sys.exit(serve_main(args))


def cmd_build_kernels(args: argparse.Namespace) -> None:
    from dsuf.gpu.build import DEFAULT_ARCHS, KernelCache, KernelCompileError, NvrtcUnavailable, build_all

    cache = KernelCache()
    try:
        results = build_all(args.arch or DEFAULT_ARCHS, cache)
    except (KernelCompileError, NvrtcUnavailable) as exc:
        raise SystemExit(f"dsuf: {exc}") from None
    for r in results:
        print(f"{r.name:14} {r.arch:8} {r.size:>9} B  {'compiled' if r.compiled else 'cached'}")
    print(f"{len(results)} kernels ready in {cache.root} ({cache.compiles} compiled)")


class OneLineErrors(argparse.ArgumentParser):
    """A command's usage errors in one line (`dsuf serve: error: ...`): serve's usage alone is a
    screenful, and `--help` shows it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsuf", description="DeepSeek Ultrafast inference engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrors)

    from dsuf.serve import add_serve_arguments

    p = sub.add_parser("serve", help="serve the OpenAI-compatible API (default: the embedded tiny model)")
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("make-tiny", help="write a tiny random checkpoint in the released layout")
    p.add_argument("--family", default="v4", choices=["v4", "v4-0731", "v41"], help="model family (v41 also writes tokenizer.json)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config.json key (JSON value); v41: text_config keys, or section.key")
    p.add_argument("--plain", action="store_true", help="write dequantised BF16 weights without quantization_config (v4 only)")
    p.set_defaults(func=cmd_make_tiny)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--ckpt", required=True, help="checkpoint folder")
        p.add_argument("--tokens", required=True, help="comma-separated token ids")
        p.add_argument("--numerics", default="reference", choices=["exact", "reference"])
        p.add_argument("--dtype", choices=["float32", "bfloat16"], help="activation dtype (default: bfloat16 for reference, float32 for exact)")

    p = sub.add_parser("logits", help="write the float32 logits of every position to a .npy file")
    model_args(p)
    p.add_argument("--mode", default="prefill", choices=["prefill", "chunked", "decode"])
    p.add_argument("--chunk", type=int, default=3, help="chunk size for --mode chunked")
    p.add_argument("--out", required=True, help="output .npy file, shape [T, vocab]")
    p.set_defaults(func=cmd_logits)

    p = sub.add_parser("generate", help="greedy generation; prints the new token ids")
    model_args(p)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--speculative", action="store_true",
                   help="draft each token after next with the MTP layer and verify it with the next (the same tokens; "
                        "prints the acceptance to stderr)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("build-kernels", help="compile every CUDA kernel with NVRTC into the kernel cache (no GPU needed)")
    p.add_argument("--arch", action="append", help="target, e.g. sm_90a or sm_100a; repeatable (default: both)")
    p.set_defaults(func=cmd_build_kernels)

    # Listed for `dsuf --help` only: main() runs `dsuf bench` before building this parser, so that
    # it imports neither the server nor its dependencies.
    sub.add_parser("bench", help="time V4-Flash decode layers on the GPU (random weights) against the HBM floor and the reference path")
    return parser


def main(argv: list[str] | None = None) -> None:
    from dsuf.model.checkpoint import CheckpointError
    from dsuf.model.config import ConfigError

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from dsuf.gpu.bench import main as bench

        sys.exit(bench(argv[1:]))
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as exc:
        print(f"dsuf: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
