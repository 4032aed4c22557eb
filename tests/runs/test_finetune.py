"""`memplan finetune`: supervised finetuning on JSONL with response-only loss, LoRA adapters on frozen weights,
checkpoints and resume through the trainer's loop, and LoRA's memory terms checked against a measured step."""

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app
from memplan.memory import gradient_bytes, lora_params, optimizer_state_bytes, peak_memory, weight_bytes
from memplan.model import ModelSpec
from memplan.setup import TrainSetup

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runs_helper import one_line_error, tiny_corpus, tiny_run  # noqa: E402

from trainer.finetune import IGNORE, _rows, batch_of, read_jsonl, render, tokenize  # noqa: E402
from trainer.lora import LoRALinear, apply_lora, merge_lora  # noqa: E402
from trainer.model import build_model  # noqa: E402

runner = CliRunner()


class CharTokenizer:
    """One id per character (and an end-of-text id), so token positions are character positions."""

    eot_id = 0
    vocab_size = 256

    def encode(self, text):
        return [ord(c) % 255 + 1 for c in text]

    def decode(self, ids):
        return "".join(chr(i - 1) for i in ids if i)


def write_jsonl(path: Path, n: int = 30) -> Path:
    with path.open("w") as f:
        for i in range(n):
            if i % 2:
                f.write(json.dumps({"prompt": f"Which animal is {i}?", "response": f"The cat is {i}."}) + "\n")
            else:
                f.write(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": f"Count to {i % 4}."},
                                                 {"role": "assistant", "content": " ".join(map(str, range(i % 4 + 1)))}
                                                 ]}) + "\n")
    return path


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    run = tiny_run(root / "run", tiny_corpus(root), steps=10)
    return run, write_jsonl(root / "sft.jsonl")


# ---- data ----------------------------------------------------------------------------------------------

def test_only_response_tokens_and_the_end_of_text_are_trained():
    tok = CharTokenizer()
    e = tokenize({"prompt": "Hi?", "response": "Yo."}, tok, "plain")
    assert e.ids == tok.encode("Hi?Yo.") + [tok.eot_id]
    assert e.trained == [False] * 3 + [True] * 3 + [True]
    chat = tokenize({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                                  {"role": "assistant", "content": "A"}]}, tok, "chat")
    text = tok.decode(chat.ids)
    assert text == "### System:\nS\n\n### User:\nU\n\n### Assistant:\nA"
    trained_text = "".join(chr(i - 1) for i, t in zip(chat.ids, chat.trained) if t and i)
    assert trained_text == "A"  # the headers, the system and the user turns are not trained


def test_targets_are_the_next_tokens_and_minus_100_outside_responses():
    tok = CharTokenizer()
    examples = [tokenize({"prompt": "ab", "response": "cd"}, tok, "plain"),
                tokenize({"prompt": "e", "response": "f"}, tok, "plain")]
    ids, mask = _rows(examples, ctx=8, packing="padded", pad_id=tok.eot_id)
    x, y = batch_of(ids, mask)
    assert x.shape == y.shape == (2, 8)
    assert y[0].tolist()[:4] == [IGNORE, tok.encode("c")[0], tok.encode("d")[0], tok.eot_id]
    assert y[0].tolist()[4:] == [IGNORE] * 4  # padding is never a target
    ids, mask = _rows(examples, ctx=4, packing="packed", pad_id=tok.eot_id)
    assert ids.shape == (2, 5)  # 8 tokens back to back: rows of ctx + 1 overlapping by one
    x, y = batch_of(ids, mask)
    assert torch.equal(x.flatten()[:8], torch.tensor(examples[0].ids + examples[1].ids))


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1 is not JSON"),
    ('{"prompt": "a"}', "expected keys prompt and response"),
    ('{"messages": [{"role": "user", "content": "a"}]}', "no assistant message"),
    ('{"messages": [{"role": "bot", "content": "a"}]}', "each message needs a role"),
])
def test_bad_jsonl_is_an_error_naming_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    from memplan.errors import InputError

    with pytest.raises(InputError, match=message):
        read_jsonl(path)


def test_plain_template_renders_prompt_and_response_as_they_are():
    assert render({"prompt": "p", "response": "r"}, "plain") == [("p", False), ("r", True)]


# ---- LoRA ----------------------------------------------------------------------------------------------

SPEC = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, tied=True)


def test_fresh_adapters_compute_the_base_model_and_only_they_train():
    torch.manual_seed(0)
    base = build_model(SPEC)
    x = torch.randint(0, 256, (2, 16))
    expected = base(x)
    model = apply_lora(base, rank=4, alpha=8.0)
    assert torch.allclose(model(x), expected, atol=1e-6)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert sum(p.numel() for n, p in model.named_parameters() if p.requires_grad) == lora_params(
        SPEC, TrainSetup(lora_rank=4))
    assert sum(isinstance(m, LoRALinear) for m in model.modules()) == 4 * SPEC.layers


def test_merging_the_adapters_keeps_the_function():
    torch.manual_seed(0)
    model = apply_lora(build_model(SPEC), rank=4, alpha=8.0)
    for m in model.modules():
        if isinstance(m, LoRALinear):
            torch.nn.init.normal_(m.lora_b, std=0.05)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        expected = model(x)
        merged = merge_lora(model)
        assert not any(isinstance(m, LoRALinear) for m in merged.modules())
        assert torch.allclose(merged(x), expected, atol=1e-5)


@pytest.mark.parametrize("arch, precision, targets", [
    ("llama", "fp32", "qkv,proj,up,down"),
    ("gpt2", "fp32", "qkv,proj,up,down"),
    ("llama", "bf16-mixed", "qkv,proj,up,down"),
    ("llama", "fp32", "qkv"),  # frozen matrices without adapters save no input
    ("gpt2", "fp32", "up,down"),  # nothing trains before the first block's MLP: its attention saves nothing
])
def test_lora_step_memory_is_predicted_within_one_percent_of_a_measured_step(arch, precision, targets):
    """The standard the rest of the walk meets: frozen weights without gradients or optimizer state,
    adapters with both, the activations the adapters save; against MemTracker on a real step."""
    from trainer.measure import measure_step_cpu

    spec = ModelSpec(arch=arch, layers=3, hidden=128, heads=4, kv_heads=2 if arch == "llama" else 4, ffn=344,
                     vocab=512, tied=arch == "llama")
    setup = TrainSetup(ctx=64, micro_batch=2, precision=precision, lora_rank=8, lora_targets=targets)
    measured = measure_step_cpu(spec, setup)
    predicted = peak_memory(spec, setup)
    assert measured.terms["gradients"] == gradient_bytes(spec, setup)
    assert measured.terms["optimizer"] == optimizer_state_bytes(spec, setup)
    assert measured.terms["weights"] - weight_bytes(spec, setup) == 2 * 64 * 16 * 4 * (arch == "llama")  # RoPE tables
    assert abs(predicted.peak_allocated - measured.peak_allocated) / measured.peak_allocated < 0.01


def test_estimate_with_lora_drops_the_frozen_weights_gradients_and_optimizer_state(memplan_cli):
    result = runner.invoke(app, ["estimate", "--params", "124m", "--device", "rtx-4090", "--ctx", "1k", "--json"])
    full = json.loads(result.stdout)
    result = runner.invoke(app, ["estimate", "--params", "124m", "--device", "rtx-4090", "--ctx", "1k", "--json",
                                 "--lora-rank", "8"])
    lora = json.loads(result.stdout)
    assert lora["setup"]["lora_rank"] == 8 and "lora_rank" not in full["setup"]
    assert lora["memory"]["optimizer"] < full["memory"]["optimizer"] / 50
    assert lora["memory"]["peak_reserved"] < full["memory"]["peak_reserved"]
    assert lora["max_micro_batch"] >= full["max_micro_batch"]
    bad = memplan_cli("estimate", "--params", "22m", "--lora-rank", "4", "--lora-targets", "mlp")
    assert bad.returncode == 2 and "--lora-targets" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


# ---- the command ---------------------------------------------------------------------------------------

def finetune(*args):
    return runner.invoke(app, ["finetune", "--device", "cpu", *args])


def test_lora_finetune_checkpoints_resumes_and_leaves_generate_a_plain_model(base_run, tmp_path):
    run, data = base_run
    out = tmp_path / "ft"
    result = finetune("--run", str(run), "--data", str(data), "--out", str(out), "--lora-rank", "4",
                      "--batch", "4", "--max-steps", "2", "--save-every", "2", "--eval-every", "2")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines if l.get("kind") == "train"] == [1, 2]
    assert any(l.get("kind") == "eval" and l["eval_loss"] > 0 for l in lines)
    meta = json.loads(next((out / "checkpoints").glob("step-*/meta.json")).read_text())
    assert meta["finetune"]["lora"] == {"rank": 4, "alpha": 16.0, "targets": "qkv,proj,up,down"}
    # resume to step 4 with the same data
    result = finetune("--run", str(run), "--data", str(data), "--out", str(out), "--resume", "--max-steps", "4")
    assert result.exit_code == 0, result.output
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("kind") == "train"]
    assert steps == [1, 2, 3, 4]
    # the frozen weights did not move: the finetune differs from the base by the adapters only
    from trainer.loop import load_trained

    base_model, _, _ = load_trained(run)
    tuned, _, _ = load_trained(out)  # adapters folded in
    base_sd, tuned_sd = base_model.state_dict(), tuned.state_dict()
    assert torch.equal(base_sd["embed.weight"], tuned_sd["embed.weight"])
    assert torch.equal(base_sd["blocks.0.norm1.weight"], tuned_sd["blocks.0.norm1.weight"])
    assert not torch.equal(base_sd["blocks.0.attn.qkv.weight"], tuned_sd["blocks.0.attn.qkv.weight"])
    gen = runner.invoke(app, ["generate", "--run", str(out), "--prompt", "### User:\nHi\n\n### Assistant:\n",
                              "--max-new-tokens", "4", "--greedy"])
    assert gen.exit_code == 0, gen.output


def test_full_finetune_with_padded_rows_trains_every_weight(base_run, tmp_path):
    run, data = base_run
    out = tmp_path / "full"
    result = finetune("--run", str(run), "--data", str(data), "--out", str(out), "--packing", "padded",
                      "--batch", "4", "--max-steps", "1", "--save-every", "1", "--eval-every", "1")
    assert result.exit_code == 0, result.output
    meta = json.loads(next((out / "checkpoints").glob("step-*/meta.json")).read_text())
    assert meta["finetune"]["lora"] is None and meta["finetune"]["packing"] == "padded"
    assert meta["plan"]["setup"]["lora_rank"] == 0


def test_finetune_errors_are_one_line(base_run, tmp_path):
    """In-process (what is under test is the message, not a process of its own; a real process's one-line
    errors are tests/unit/test_sweep.py's and test_hostile*'s)."""
    run, data = base_run
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{oops\n')
    one_line_error(finetune("--run", str(run), "--data", str(bad), "--out", str(tmp_path / "x"), "--batch", "2"),
                   "line 2 is not JSON")
    one_line_error(finetune("--run", str(tmp_path / "nope"), "--data", str(data), "--out", str(tmp_path / "y")),
                   "nope: no such directory")
    one_line_error(finetune("--run", str(run), "--data", str(data), "--out", str(tmp_path / "z"), "--lora-rank", "4",
                            "--lora-targets", "attn"), "--lora-targets: unknown attn")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # nothing left by the refusals
    assert not (tmp_path / "x").exists() and not (tmp_path / "z").exists()
