"""``memplan generate``: continue a prompt with a trained run's model (KV cache, streamed to stdout; stats to stderr)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from memplan.cli.app import app
from memplan.cli.options import CheckpointOpt, ThreadsOpt, threads_from, use_threads
from memplan.errors import InputError
from memplan.run_control import SEED_MAX
from memplan.units import parse_float, parse_int

_G = "Generation"
RunOpt = Annotated[str, typer.Option("--run", metavar="RUN", help="A run directory (`memplan train --out RUN` or `memplan finetune`).",
                                     show_default=False)]
PromptOpt = Annotated[str, typer.Option("--prompt", metavar="TEXT", help="The text to continue (empty: start a new document).",
                                        show_default=False)]
MaxNewOpt = Annotated[str, typer.Option("--max-new-tokens", metavar="N", help="Tokens to generate at most (end-of-text stops "
                                        "earlier).", rich_help_panel=_G)]
GreedyOpt = Annotated[bool, typer.Option("--greedy", help="Always the most likely token: the same text on every call.",
                                         rich_help_panel=_G)]
TemperatureOpt = Annotated[str, typer.Option("--temperature", metavar="T", help="Softmax temperature (lower: safer, higher: more "
                                             "varied).", rich_help_panel=_G)]
TopKOpt = Annotated[str, typer.Option("--top-k", metavar="N", help="Sample among the k most likely tokens (0: all).",
                                      rich_help_panel=_G)]
TopPOpt = Annotated[str, typer.Option("--top-p", metavar="P", help="Sample among the most likely tokens whose probabilities sum "
                                      "to p (1: all).", rich_help_panel=_G)]
RepetitionOpt = Annotated[str, typer.Option("--repetition-penalty", metavar="X", help="Divide the logits of tokens already seen "
                                            "by this (1: off; 1.1-1.3 breaks loops).", rich_help_panel=_G)]
SeedOpt = Annotated[str, typer.Option("--seed", metavar="N", help="Seed of the sampling, 0 to 4294967295 (same seed, same text).",
                                      rich_help_panel=_G)]
SlidingOpt = Annotated[bool, typer.Option(
    "--sliding-window", help="Go on past the model's context window: when it is full its newest half is kept "
    "(without it, a prompt and --max-new-tokens beyond the window are refused).", rich_help_panel=_G)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print {text, stats} as JSON instead of streaming.")]

LOOP_WARNING = 0.5  # a repetition score above this is called out: the output loops
PROGRESS_SECONDS = 10.0  # a generation running longer says its progress and rate on stderr this often


def check_length(prompt_tokens: int, max_new_tokens: int, window: int, sliding: bool) -> None:
    """Refuse a generation beyond the model's context window unless ``--sliding-window`` asks for one."""
    if not sliding and prompt_tokens + max_new_tokens > window:
        room = max(0, window - prompt_tokens)
        raise InputError(f"--max-new-tokens {max_new_tokens:,}: the prompt ({prompt_tokens:,} tokens) and "
                         f"{max_new_tokens:,} new tokens exceed the model's context window of {window:,} tokens; "
                         f"use --max-new-tokens {room:,} or less, or --sliding-window to go on past it (its newest "
                         "half kept each time it is full)")


class Progress:
    """``on_token`` for a long generation: every ``PROGRESS_SECONDS`` a line on stderr with the tokens so far,
    the rate and the time left at that rate."""

    def __init__(self, err, total: int, streaming: bool):
        import time

        self.err, self.total, self.streaming = err, total, streaming
        self.start = self.last = time.perf_counter()

    def __call__(self, stats) -> None:
        import time

        from memplan.units import format_seconds

        now = time.perf_counter()
        if now - self.last < PROGRESS_SECONDS:
            return
        self.last = now
        rate = stats.new_tokens / max(now - self.start, 1e-9)
        left = (self.total - stats.new_tokens) / rate if rate > 0 else None
        self.err.print(("\n" if self.streaming else "") + f"[dim]generating: {stats.new_tokens:,} of "
                       f"{self.total:,} tokens, {rate:,.1f} tokens/s, {format_seconds(left)} left at this rate[/]",
                       soft_wrap=True)


def inference_precision(plan_precision: str, device_type: str) -> str:
    """The precision generation runs in: the plan's autocast on a GPU; on a CPU the weights' own dtype
    (fp32, or bf16 for a pure-bf16 run): CPU autocast to bf16 is slower than fp32 there."""
    if device_type == "cpu" and plan_precision in ("bf16-mixed", "fp16-mixed"):
        return "fp32"
    return plan_precision


@app.command("generate")
def generate_command(
    run: RunOpt, prompt: PromptOpt = "", max_new_tokens: MaxNewOpt = "128", greedy: GreedyOpt = False,
    temperature: TemperatureOpt = "0.8", top_k: TopKOpt = "50", top_p: TopPOpt = "1.0",
    repetition_penalty: RepetitionOpt = "1.0", seed: SeedOpt = "0", checkpoint: CheckpointOpt = None,
    json: JsonOpt = False, threads: ThreadsOpt = None, sliding_window: SlidingOpt = False,
) -> None:
    """Continue --prompt with the run's model: tokens stream to stdout; tokens/s and a repetition score to stderr."""
    from rich.console import Console

    from memplan.cli.options import print_json
    from memplan.cli.train import printable

    config_kwargs = dict(
        max_new_tokens=parse_int(max_new_tokens, "--max-new-tokens", minimum=0), greedy=greedy,
        temperature=parse_float(temperature, "--temperature", low=0, low_open=True, example="0.8"),
        top_k=parse_int(top_k, "--top-k", minimum=0),
        top_p=parse_float(top_p, "--top-p", low=0, low_open=True, high=1, example="0.9"),
        repetition_penalty=parse_float(repetition_penalty, "--repetition-penalty", low=0, low_open=True,
                                       example="1.2"),
        seed=parse_int(seed, "--seed", minimum=0, maximum=SEED_MAX))
    threads_from(threads)  # a bad value is refused before torch starts

    from trainer.generate import SamplingConfig, context_window, generate_text
    from trainer.device import torch_device_for
    from trainer.loop import load_trained

    config = SamplingConfig(**config_kwargs)
    use_threads(threads)
    device = torch_device_for()
    model, tokenizer, meta = load_trained(run, device=device, checkpoint=checkpoint)
    precision = inference_precision(meta["plan"]["setup"]["precision"], device.type)
    window = context_window(model, meta)
    check_length(len(tokenizer.encode(prompt) or [tokenizer.eot_id]), config.max_new_tokens, window, sliding_window)
    err = Console(stderr=True, highlight=False)

    def stream(piece: str) -> None:
        sys.stdout.write(printable(piece))
        sys.stdout.flush()

    text, stats = generate_text(model, tokenizer, prompt, config, window=window, precision=precision,
                                on_text=None if json else stream,
                                on_token=Progress(err, config.max_new_tokens, streaming=not json))
    if json:
        print_json({"prompt": prompt, "text": text, "run": str(run), "step": meta.get("step"),
                    "sampling": {k: getattr(config, k) for k in ("max_new_tokens", "greedy", "temperature", "top_k",
                                                                  "top_p", "repetition_penalty", "seed")},
                    "device": str(device), "precision": precision, "window": window, "stats": stats.to_json()})
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    tps = stats.tokens_per_second
    decode = stats.decode_tokens_per_second
    line = (f"{stats.new_tokens} tokens in {stats.prefill_seconds + stats.decode_seconds:.2f} s"
            + (f": {tps:,.1f} tokens/s" if tps else "")
            + (f" (decode {decode:,.1f} tokens/s; prompt {stats.prompt_tokens} tokens in "
               f"{stats.prefill_seconds * 1000:.0f} ms)" if decode else f" (prompt {stats.prompt_tokens} tokens)")
            + f"; repetition {stats.repetition:.2f} (share of repeated 4-grams)"
            + ("; stopped at end-of-text" if stats.stopped == "eot" else "")
            + ("; stopped: the logits were not finite (NaN), so no token could be chosen; the model's weights "
               "hold NaN or inf" if stats.stopped == "nonfinite" else "")
            + (f"; the window of {window} tokens was full {stats.context_shifts}× (its newest half kept)"
               if stats.context_shifts else ""))
    err.print(line, soft_wrap=not err.is_terminal)  # a terminal wraps it at its width; a log keeps one line
    if stats.repetition > LOOP_WARNING:
        err.print("[yellow]note[/]: the output repeats itself; try sampling (drop --greedy), "
                  "--repetition-penalty 1.2, or a longer-trained model", soft_wrap=not err.is_terminal)
