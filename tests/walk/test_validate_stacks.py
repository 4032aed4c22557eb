"""memplan validate --stack: other stacks' real steps on this CPU, side by side with memplan's own."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from runs_helper import one_line_error

pytest.importorskip("transformers")
pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MATRIX = """
[[config]]
name = "llama-gqa-bf16"
arch = "llama"
layers = 2
hidden = 64
heads = 4
kv_heads = 2
ffn = 128
vocab = 320
tied = false
ctx = 64
micro_batch = 2
precision = "bf16-mixed"
attention = "sdpa"

[[config]]
name = "llama-selective"
arch = "llama"
layers = 2
hidden = 64
heads = 4
kv_heads = 2
ffn = 128
vocab = 320
tied = true
ctx = 64
micro_batch = 2
precision = "fp32"
checkpointing = "selective"
"""


def test_validate_measures_each_stack_and_keeps_their_figures_apart(tmp_path):
    matrix = tmp_path / "m.toml"
    matrix.write_text(MATRIX)
    result = CliRunner().invoke(app, ["validate", "--matrix", str(matrix), "--stack", "memplan,transformers",
                                      "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    rows = {(r["name"], r.get("stack", "memplan")): r for r in data["rows"]}
    # transformers cannot take memplan's selective checkpointing: that config ran for memplan only
    assert set(rows) == {("llama-gqa-bf16", "memplan"), ("llama-selective", "memplan"),
                         ("llama-gqa-bf16 (transformers)", "transformers")}
    theirs = rows[("llama-gqa-bf16 (transformers)", "transformers")]
    assert theirs["trace_error"] == 0.0  # the stack's trace is its measured peak, to the byte
    # transformers keeps an fp32 copy of every RMSNorm input (memplan's norm does not): it peaks higher
    assert theirs["measured_allocated"] > rows[("llama-gqa-bf16", "memplan")]["measured_allocated"]
    assert set(data["stacks"]) == {"memplan", "transformers"}
    assert data["stacks"]["transformers"]["trace_max_abs_error"] == 0.0


@pytest.mark.parametrize("args,needles", [
    (["--stack", "megatron"], ["--stack", "megatron", "memplan, transformers"]),
    (["--stack", "transformers,transformers"], ["--stack", "each once"]),
    (["--stack", "transformers", "--mode", "inference"], ["--stack transformers", "--mode training"]),
    (["--stack", "transformers", "--world-size", "2"], ["--stack transformers", "--world-size 1"]),
])
def test_validate_stack_bad_input_is_one_line(args, needles):
    one_line_error(CliRunner().invoke(app, ["validate", "--quick", "--device", "cpu", *args]), *needles)


def test_a_matrix_no_config_of_which_a_stack_can_take_is_one_line(tmp_path):
    matrix = tmp_path / "m.toml"
    matrix.write_text(MATRIX.split("[[config]]")[0] + "[[config]]" + MATRIX.split("[[config]]")[2])
    result = CliRunner().invoke(app, ["validate", "--matrix", str(matrix), "--stack", "transformers", "--device", "cpu"])
    one_line_error(result, "no config", "selective")


def test_validate_prints_the_stacks_side_by_side_and_bars_per_stack(tmp_path):
    matrix = tmp_path / "m.toml"
    matrix.write_text(MATRIX)
    result = CliRunner().invoke(app, ["validate", "--matrix", str(matrix), "--stack", "memplan,transformers",
                                      "--device", "cpu"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "llama-gqa-bf16 (transformers)" in out  # the row names survive rich's markup
    assert "Measured peak allocated per stack" in out
    assert "transformers (the walk with its hooks against the measured transformers step):" in out
    assert "not run: 1 config(s)" in out and "selective" in out
