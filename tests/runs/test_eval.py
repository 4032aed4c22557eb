"""memplan eval: held-out loss and perplexity per source and overall, on the run's own split or another corpus
prepared with the same tokenizer; another tokenizer, a missing run, or a context beyond the model are one-line
errors.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from memplan.cli import app
from runs_helper import one_line_error, story, tiny_corpus, tiny_run
from trainer import data as data_mod
from trainer.data import PreparedData
from trainer.loop import load_trained


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    corpus = tiny_corpus(root)
    run = tiny_run(root / "run", corpus, arch="llama", steps=12)
    tokenizer_json = sorted((run / "checkpoints").iterdir())[-1] / "tokenizer.json"
    # a second corpus of two sources, prepared with the run's own tokenizer.json
    (root / "two").mkdir()
    (root / "two" / "tales.jsonl").write_text(
        "".join(json.dumps({"text": story(1000 + i)}) + "\n" for i in range(120)))
    (root / "two" / "lists.jsonl").write_text("".join(json.dumps({"text": " ".join(
        f"item {j} of list {i} is a {['cat', 'dog', 'owl'][j % 3]}." for j in range(12))}) + "\n" for i in range(60)))
    (root / "two" / "one.txt").write_text(story(5000) * 4)  # one document: its held-out fifth is under a window
    two = root / "two-prepared"
    data_mod.prepare(data_mod.resolve_inputs([str(root / "two" / "tales.jsonl"), str(root / "two" / "lists.jsonl"),
                                                str(root / "two" / "one.txt")]), two,
                     data_mod.PrepareConfig(tokenizer=str(tokenizer_json), workers=1, val_fraction=0.2))
    other_tok = tiny_corpus(root, tokenizer="bpe:300", n=120, name="other-tokenizer")
    return {"root": root, "corpus": corpus, "run": run, "two": two, "other_tok": other_tok}


def cli(*args):
    return CliRunner().invoke(app, ["eval", *args])



def logged_evals(run):
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line.get("kind") == "eval"]


def test_eval_on_the_runs_own_split_reproduces_the_loss_the_trainer_logged(env):
    result = cli("--run", str(env["run"]), "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    last = logged_evals(env["run"])[-1]
    assert out["step"] == last["step"] == 12
    assert out["own_data"] is True
    # the tiny val split has fewer windows than the trainer's eval_batches × batch: both read all of them
    assert out["eval_tokens"] == last["eval_tokens"]
    assert out["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)
    assert out["eval_ppl"] == pytest.approx(math.exp(out["eval_loss"]), rel=1e-12)
    assert [s["name"] for s in out["sources"]] == list(last["eval_loss_by_source"])


def test_eval_loss_is_the_mean_cross_entropy_over_every_held_out_window(env):
    """An independent loop over the val split's non-overlapping (ctx + 1)-token windows gives the same number."""
    result = cli("--run", str(env["run"]), "--data", str(env["two"]), "--ctx", "32", "--batch", "3", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["own_data"] is False and out["ctx"] == 32 and out["batch"] == 3
    model, _, _ = load_trained(env["run"])
    prepared = PreparedData(env["two"])
    total, count = 0.0, 0
    by_source = {}
    for s in prepared.sources:
        ids = prepared.val.read(s.val_offset, s.val_tokens).astype(np.int64)
        n_windows = max(0, (len(ids) - 1) // 32)
        if n_windows == 0:
            continue
        windows = torch.from_numpy(np.stack([ids[i * 32:i * 32 + 33] for i in range(n_windows)]))
        with torch.no_grad():
            logits = model(windows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1), reduction="sum")
        by_source[s.name] = (float(loss) / windows[:, 1:].numel(), windows[:, 1:].numel())
        total += float(loss)
        count += windows[:, 1:].numel()
    assert len(by_source) == 2
    held = prepared.source("one").val_tokens
    assert 0 < held < 33  # held out by a window of its text, too short for one window of ctx 32
    assert out["sources"][2] == {"name": "one", "eval_loss": None, "eval_ppl": None, "eval_tokens": 0,
                                 "val_tokens": held}
    for s in out["sources"][:2]:
        assert s["eval_loss"] == pytest.approx(by_source[s["name"]][0], rel=1e-5)
        assert s["eval_tokens"] == by_source[s["name"]][1]
    assert out["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert out["eval_tokens"] == count


def test_max_batches_takes_that_many_batches_per_source(env):
    out = json.loads(cli("--run", str(env["run"]), "--data", str(env["two"]), "--ctx", "16", "--batch", "2",
                         "--max-batches", "3", "--json").stdout)
    held = PreparedData(env["two"]).source("one").val_tokens  # a window's tail of one document: under 3 × 2 windows
    assert [s["eval_tokens"] for s in out["sources"]] == [3 * 2 * 16] * 2 + [16 * ((held - 1) // 16)]


def test_threads_is_accepted_and_leaves_the_loss_as_it_is(env):
    import torch

    args = ["--run", str(env["run"]), "--data", str(env["two"]), "--ctx", "16", "--batch", "2", "--max-batches", "2",
            "--json"]
    before = torch.get_num_threads()
    try:
        one = cli(*args, "--threads", "1")
        assert one.exit_code == 0, one.output
        assert torch.get_num_threads() == 1
        assert json.loads(one.stdout)["eval_loss"] == pytest.approx(json.loads(cli(*args).stdout)["eval_loss"],
                                                                   rel=1e-5)
    finally:
        torch.set_num_threads(before)


def test_the_table_lists_every_source_and_the_overall_perplexity(env):
    result = cli("--run", str(env["run"]), "--data", str(env["two"]))
    assert result.exit_code == 0, result.output
    out = json.loads(cli("--run", str(env["run"]), "--data", str(env["two"]), "--json").stdout)
    for s in out["sources"][:2]:
        assert s["name"] in result.stdout
        assert f"{s['eval_ppl']:,.2f}" in result.stdout
    assert "one" in result.stdout and "< one window" in result.stdout
    assert "overall" in result.stdout and f"{out['eval_ppl']:,.2f}" in result.stdout
    assert "not the run's own data" in result.stdout


# ---- bad input: one line, exit 2 ---------------------------------------------------------------------

def test_a_corpus_with_another_tokenizer_is_refused_naming_the_fix(env):
    line = one_line_error(cli("--run", str(env["run"]), "--data", str(env["other_tok"])),
                          "another tokenizer", "memplan prepare --input", "--out", "--tokenizer", "tokenizer.json")
    # the command it names is whole, and it works: the corpus it prepares is accepted
    import shlex

    command = shlex.split(line.split("`")[1])
    assert command[:2] == ["memplan", "prepare"]
    out = Path(command[command.index("--out") + 1])
    assert out != Path(env["other_tok"]) and not out.exists()  # never over the corpus given
    tokenizer = Path(command[command.index("--tokenizer") + 1])
    assert tokenizer.is_file() and tokenizer.parent.parent.name == "checkpoints"  # RUN/checkpoints/step-N/
    prepared = CliRunner().invoke(app, command[1:] + ["--workers", "1"])
    assert prepared.exit_code == 0, prepared.output
    assert cli("--run", str(env["run"]), "--data", str(out), "--ctx", "16").exit_code == 0


def test_a_missing_run_or_one_without_checkpoints_is_a_clear_error(env, tmp_path):
    one_line_error(cli("--run", str(tmp_path / "nowhere")), "no such directory")
    (tmp_path / "empty").mkdir()
    one_line_error(cli("--run", str(tmp_path / "empty")), "no checkpoint")


def test_a_corrupt_checkpoint_is_named(env, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(env["run"], run)
    newest = sorted((run / "checkpoints").iterdir())[-1]
    (newest / "model.safetensors").write_bytes(b"\0" * 10)
    one_line_error(cli("--run", str(run)), "model.safetensors")


def test_a_window_longer_than_every_split_names_the_longest(env):
    line = one_line_error(cli("--run", str(env["run"]), "--ctx", "8k"), "no source holds a full window of --ctx 8192")
    longest = int(line.split("use --ctx ")[1].split()[0])
    assert cli("--run", str(env["run"]), "--ctx", str(longest), "--max-batches", "1").exit_code == 0


@pytest.mark.parametrize("flag,value", [("--ctx", "big"), ("--batch", "0"), ("--max-batches", "-1")])
def test_bad_numbers_are_one_line_errors(env, flag, value):
    one_line_error(cli("--run", str(env["run"]), flag, value), flag)


@pytest.mark.slow  # it trains (3 tiny steps)
def test_the_summary_gives_the_held_out_token_count_and_the_eval_that_reproduces_it(env, tmp_path):
    """Issue 28: the summary's held-out loss was a sample of the split (eval_batches batches a source) and
    nothing said so, while `memplan eval` read the whole split and gave another figure. The summary names the
    token count and the `memplan eval` command that reproduces the figure exactly, with the same count."""
    import re

    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--data", str(env["corpus"]), "--out", str(run), "--arch", "llama",
                                      "--layers", "1", "--hidden", "32", "--heads", "2", "--ffn", "64", "--ctx", "32",
                                      "--batch", "2", "--max-steps", "3", "--eval-batches", "1",
                                      "--sample-tokens", "0"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    last = logged_evals(run)[-1]
    found = re.search(r"held-out loss ([\d.]+), .*? over ([\d,]+) of the held-out split's ([\d,]+) tokens "
                      r"\(`memplan eval --run (\S+) --max-batches (\d+)` gives the same", text)
    assert found, text
    loss, count, split, run_named, batches = found.groups()
    assert float(loss) == pytest.approx(last["eval_loss"], abs=5e-5)
    assert int(count.replace(",", "")) == last["eval_tokens"] < int(split.replace(",", ""))
    assert (run_named, batches) == (str(run), "1")
    same = json.loads(cli("--run", run_named, "--max-batches", batches, "--json").stdout)
    assert same["eval_tokens"] == last["eval_tokens"]
    assert same["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-9)
    whole = json.loads(cli("--run", run_named, "--json").stdout)
    assert whole["eval_tokens"] > last["eval_tokens"]
