"""`memplan estimate`: the JSON of docs/json.md, fits and max_micro_batch, and every bad input users type."""

import json

import pytest
from typer.testing import CliRunner

from memplan.cli import app
from memplan.estimate import estimate, fits_on, max_micro_batch
from memplan.hardware import load_profile
from memplan.model import from_size
from memplan.setup import TrainSetup

runner = CliRunner()

CONTRACT = {
    "model": {"params", "arch", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "tied"},
    "setup": {"ctx", "micro_batch", "grad_accum", "precision", "attention", "checkpointing", "optimizer", "world_size",
              "sharding"},
    "device": {"name", "memory_bytes", "usable_bytes"},
    "memory": {"weights", "gradients", "optimizer", "activations", "logits", "temporaries", "runtime", "peak_allocated",
               "peak_reserved", "peak_phase"},
    "time": {"flops_per_step", "step_seconds", "tokens_per_second", "mfu", "epoch_seconds"},
}


def run(*args):
    return runner.invoke(app, ["estimate", *args])


def test_json_has_every_contract_key_with_the_right_types():
    result = run("--params", "124m", "--ctx", "2k", "--batch", "4", "--device", "rtx-4090", "--tokens", "1b", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key, fields in CONTRACT.items():
        assert fields <= set(data[key]), key
    assert isinstance(data["fits"], bool) and isinstance(data["max_micro_batch"], int)
    assert data["setup"]["ctx"] == 2048 and data["model"]["params"] == from_size("124m").params
    mem = data["memory"]
    assert mem["peak_reserved"] == mem["peak_allocated"] + mem["runtime"]
    assert sum(mem[k] for k in ("weights", "gradients", "optimizer", "activations", "logits", "temporaries")) == \
        mem["peak_allocated"]
    assert mem["peak_phase"] in ("forward", "backward", "optimizer")
    assert data["time"]["epoch_seconds"] == pytest.approx(1e9 / data["time"]["tokens_per_second"])


def test_human_output_prints_the_chosen_shape_and_the_verdict():
    result = run("--params", "1.1b", "--ctx", "2k", "--device", "gtx-1650")
    assert result.exit_code == 0
    assert "22 layers, hidden 2048, 32 heads (4 kv), ffn 5632" in result.stdout
    assert "does not fit" in result.stdout


def test_a_setup_that_does_not_fit_is_an_answer():
    result = run("--params", "7b", "--device", "gtx-1650", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["fits"] is False and data["max_micro_batch"] == 0


def test_max_micro_batch_is_the_largest_that_fits():
    spec, device = from_size("124m"), load_profile("rtx-3060-12gb")
    setup = TrainSetup(ctx=1024, precision="bf16-mixed")
    best = max_micro_batch(spec, setup, device)
    assert best > 1
    assert fits_on(spec, setup.replace(micro_batch=best), device)
    assert not fits_on(spec, setup.replace(micro_batch=best + 1), device)
    assert estimate(spec, setup, device).max_micro_batch == best


def test_checkpointing_and_eager_attention_move_the_peak_the_right_way():
    spec, device = from_size("350m"), load_profile("rtx-4090")
    base = TrainSetup(ctx=2048, micro_batch=4)
    none = estimate(spec, base, device).memory.peak_allocated
    full = estimate(spec, base.replace(checkpointing="full"), device).memory.peak_allocated
    eager = estimate(spec, base.replace(attention="eager"), device).memory.peak_allocated
    assert full < none < eager


@pytest.mark.parametrize("args,fragment", [
    (["--params", "1x"], "--params: '1x' is not a size"),
    (["--ctx", "-5"], "--ctx: '-5'"),
    (["--ctx", "8q"], "--ctx: '8q' is not a count"),
    (["--hidden", "2048", "--heads", "7"], "--heads 7 does not divide --hidden 2048"),
    (["--kv-heads", "5", "--heads", "32"], "--kv-heads 5 does not divide --heads 32"),
    (["--device", "rtx-409"], "did you mean rtx-4090"),
    (["--precision", "fp8"], "accepted: fp32, tf32, bf16-mixed, fp16-mixed, bf16"),
    (["--batch", "0"], "--batch"),
    (["--params", "22m", "--model", "gpt2"], "not both"),
    (["--no-such-flag"], "No such option"),
])
def test_bad_input_is_one_line_and_exit_2(args, fragment, memplan_cli):
    result = memplan_cli("estimate", *args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_bad_config_json_and_bad_profile_toml_are_one_line_errors(tmp_path, memplan_cli):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "hidden_size": 64}')
    result = memplan_cli("estimate", "--model", str(config))
    assert result.returncode == 2 and "missing key(s)" in result.stderr and len(result.stderr.splitlines()) == 1
    config.write_text("not json")
    result = memplan_cli("estimate", "--model", str(config))
    assert result.returncode == 2 and "is not JSON" in result.stderr

    profile = tmp_path / "my-gpu.toml"
    profile.write_text((load_profile("rtx-4090").path and open(load_profile("rtx-4090").path).read())
                       .replace("bandwidth_bytes_per_second", "bandwidth"))
    result = memplan_cli("estimate", "--device", str(profile))
    assert result.returncode == 2
    assert "missing field memory.bandwidth_bytes_per_second" in result.stderr


def test_a_profile_file_of_the_same_schema_is_a_device(tmp_path):
    text = open(load_profile("rtx-4090").path).read()
    path = tmp_path / "renamed.toml"
    path.write_text(text.replace('name = "rtx-4090"', 'name = "my-4090"'))
    result = run("--params", "22m", "--device", str(path), "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["device"]["name"] == "my-4090"


def test_estimate_never_imports_torch(memplan_cli):
    result = memplan_cli("estimate", "--params", "22m", "--device", "cpu", "--json",
                         env={"PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0
    import subprocess
    import sys
    code = ("import sys, json\nfrom typer.testing import CliRunner\nfrom memplan.cli import app\n"
            "r = CliRunner().invoke(app, ['estimate', '--params', '124m', '--device', 'cpu', '--json'])\n"
            "assert r.exit_code == 0\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(__import__("conftest").ROOT))
    assert out.stdout.strip() == "False", out.stderr


# ---- advice when no micro-batch fits (issue 14): only levers not already pulled, re-estimated ----

def test_advice_never_suggests_a_lever_already_pulled_and_says_what_each_gives():
    from memplan.advice import levers
    from memplan.estimate import memory_on

    spec, device = from_size("124m"), load_profile("gtx-1650")
    pulled = TrainSetup(ctx=32768, precision="bf16", checkpointing="full", optimizer="adamw8bit")
    found = levers(spec, pulled, device)
    assert found
    changes = " ".join(lever.change for lever in found)
    for already in ("--checkpointing", "--precision", "--optimizer"):
        assert already not in changes
    base = memory_on(spec, pulled, device).peak_reserved
    for lever in found:
        assert lever.peak_reserved < base  # each one changes something
        assert lever.fits == (lever.peak_reserved <= device.usable_bytes)
    ctx = next(lever for lever in found if lever.change.startswith("--ctx"))
    shorter = int(ctx.change.split()[1])
    assert ctx.peak_reserved == memory_on(spec, pulled.replace(ctx=shorter), device).peak_reserved
    assert ctx.fits and not fits_on(spec, pulled.replace(ctx=shorter + 64), device)
    # nothing pulled yet: checkpointing is offered
    assert any(lever.change == "--checkpointing full"
               for lever in levers(spec, TrainSetup(ctx=32768, precision="bf16"), device))


def test_estimate_says_no_micro_batch_fits_without_suggesting_checkpointing_already_on():
    args = ("--model", "tinyllama-1.1b", "--precision", "bf16-mixed", "--checkpointing", "full",
            "--device", "gtx-1650")
    out = run(*args)
    assert out.exit_code == 0, out.output
    text = " ".join(out.stdout.split())
    assert "No micro-batch fits" in text and "try checkpointing" not in text
    assert "--checkpointing" not in text.split("No micro-batch fits")[1].split("Time per step")[0]
    assert "--world-size" in text and "fits (largest micro-batch" in text
    data = json.loads(run(*args, "--json").stdout)
    assert data["advice"] and all(a["change"] and a["peak_reserved"] > 0 for a in data["advice"])
    assert not any(a["change"].startswith("--checkpointing") for a in data["advice"])
    assert json.loads(run("--params", "22m", "--device", "rtx-4090", "--json").stdout)["advice"] == []


def test_without_precision_a_device_without_bf16_is_estimated_in_its_best_precision_for_memory_and_time():
    """Issue 28: on the gtx-1650 (no native bf16) estimate took memory for bf16-mixed and time for fp32; without
    --precision it now takes the device's best, as train and autotune do, for both."""
    def run(*extra):
        result = CliRunner().invoke(app, ["estimate", "--params", "124m", "--device", "gtx-1650", *extra, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    default, fp32 = run(), run("--precision", "fp32")
    assert default["setup"]["precision"] == "fp32"
    assert default["memory"] == fp32["memory"] and default["time"]["step_seconds"] == fp32["time"]["step_seconds"]
    assert not any("bf16" in note for note in default["time"]["notes"])
    assert run("--precision", "bf16-mixed")["setup"]["precision"] == "bf16-mixed"  # asked for: as asked
    text = CliRunner().invoke(app, ["estimate", "--params", "124m", "--device", "gtx-1650"]).stdout
    assert "precision fp32, gtx-1650's best" in " ".join(text.split())
    assert run_device("rtx-4090")["setup"]["precision"] == "bf16-mixed"


def run_device(name: str) -> dict:
    return json.loads(CliRunner().invoke(app, ["estimate", "--params", "124m", "--device", name, "--json"]).stdout)
