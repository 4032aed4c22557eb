"""Does llama.cpp itself load memplan's GGUF exports and compute what the trainer computes?

For each exportable family (llama tied and untied, qwen2, gpt2, gpt_neox with partial rotary) this trains a
tiny model on generated stories (150 steps, seconds each), exports it with ``memplan export --format gguf``
in float32, float16 and q8_0, loads the file in llama.cpp (node-llama-cpp's prebuilt CPU build), and compares

- tokenization: llama.cpp's ids for each prompt (through the GGUF vocabulary, merges and the ``gpt-2``
  pre-tokenizer) against the run's own tokenizer;
- greedy decoding: llama.cpp's tokens (temperature 0) against ``trainer.generate`` greedy, token by token.
  llama.cpp stops at end-of-text (the GGUF's EOS/EOT); there memplan must have chosen end-of-text too.

It needs Node.js and node-llama-cpp, which are not Python dependencies of memplan:

    mkdir /tmp/llcpp && cd /tmp/llcpp && npm init -y && npm i -E node-llama-cpp@3.21.1
    python benchmarks/export_llama_cpp.py --node-project /tmp/llcpp [--tokens 24]

Exit status 1 if llama.cpp tokenizes any prompt differently, or decodes a float32 export differently. float16 and
q8_0 exports round the weights, so near-ties among the tiny models' next tokens may flip: those greedy counts
are reported, not judged (measured on 2026-11-30: float16 72/72 for every family; q8_0 72/72 for llama and gpt2,
70/72 for qwen2 and gpt_neox).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

NODE_SCRIPT = r"""
import {getLlama, LlamaLogLevel} from "node-llama-cpp";
const [modelPath, prompt, nTokens] = [process.argv[2], process.argv[3], parseInt(process.argv[4])];
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error});
const model = await llama.loadModel({modelPath});
const ids = model.tokenize(prompt);
const context = await model.createContext({contextSize: 256, batchSize: 64, threads: 1});
const out = [];
for await (const t of context.getSequence().evaluate(ids, {temperature: 0})) {
  out.push(Number(t));
  if (out.length >= nTokens) break;
}
console.log(JSON.stringify({prompt_ids: Array.from(ids).map(Number), output_ids: out}));
process.exit(0);
"""

CASES = {"llama": dict(arch="llama"), "llama-untied": dict(arch="llama", tied=False),
         "qwen2": dict(arch="llama", qkv_bias=True), "gpt2": dict(arch="gpt2"),
         "gpt_neox": dict(arch="gpt_neox", rotary_pct=0.25, tied=False)}
PROMPTS = ["Story 7. Once upon a time", "Story 123. Once upon a time a", "It met a dog and"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--node-project", required=True, help="a directory where node-llama-cpp is installed")
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt")
    ap.add_argument("--steps", type=int, default=150, help="training steps of each tiny model")
    args = ap.parse_args()

    import torch

    from runs_helper import tiny_corpus, tiny_run
    from trainer.export import export_run
    from trainer.generate import SamplingConfig, context_window, generate_text
    from trainer.loop import load_trained

    torch.set_num_threads(1)
    script = Path(args.node_project) / "memplan-gguf-check.mjs"
    script.write_text(NODE_SCRIPT)
    failures = 0
    print(f"{'family':<13} {'dtype':<8} {'tokenization':>12} {'greedy tokens':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = tiny_corpus(root)
        for name, shape in CASES.items():
            run = tiny_run(root / f"run-{name}", corpus, steps=args.steps, **shape)
            model, tok, meta = load_trained(run)
            for dtype in ("float32", "float16", "q8_0"):
                out = root / f"{name}-{dtype}.gguf"
                export_run(run, "gguf", out, dtype=dtype)
                tok_ok = gen_ok = 0
                for prompt in PROMPTS:
                    done = subprocess.run(["node", str(script), str(out), prompt, str(args.tokens)], capture_output=True,
                                          text=True, timeout=300, cwd=args.node_project)
                    if done.returncode != 0:
                        print(done.stderr[-2000:], file=sys.stderr)
                        return 1
                    theirs = json.loads(done.stdout.strip().splitlines()[-1])
                    _, stats = generate_text(model, tok, prompt, SamplingConfig(greedy=True, max_new_tokens=args.tokens,
                                                                                stop_at_eot=False),
                                             window=context_window(model, meta))
                    ours = stats.output_ids
                    tok_ok += theirs["prompt_ids"] == tok.encode(prompt)
                    same = next((i for i, (a, b) in enumerate(zip(theirs["output_ids"], ours)) if a != b),
                                min(len(theirs["output_ids"]), len(ours)))
                    stopped_at_eot = same == len(theirs["output_ids"]) < args.tokens and ours[same] == tok.eot_id
                    gen_ok += args.tokens if (same == args.tokens or stopped_at_eot) else same
                total = args.tokens * len(PROMPTS)
                failures += (tok_ok != len(PROMPTS)) + (dtype == "float32" and gen_ok != total)
                print(f"{name:<13} {dtype:<8} {f'{tok_ok}/{len(PROMPTS)}':>12} {f'{gen_ok}/{total}':>14}", flush=True)
    print("all equal" if not failures else f"{failures} disagreement(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
