"""memplan train --from CHECKPOINT (continued pretraining of a Hugging Face checkpoint) and the tokenizer it needs:
`memplan prepare --tokenizer CHECKPOINT` prepares a corpus with the checkpoint's own tokenizer (its end-of-text id
and its padded vocabulary); the run starts from the checkpoint's weights (the logits transformers computes), records
where they came from, resumes bit-identically after kill -9, and starts again from them (checked unchanged) when it
was killed before its first checkpoint. A Hub id is looked up in the Hugging Face cache and otherwise fetched,
which offline is a one-line error naming the cache."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runs_helper import one_line_error  # noqa: E402
from test_hf_import import SHAPE, TOL, copy_checkpoint, edit_weights, tokenizer, write_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
PADDED = 320  # the embedding's rows: past the tokenizer's 300, as real checkpoints pad theirs
TEXT = "".join(f"Story {i}. Once upon a time a fox met an owl by the river. Which animal is {i}? The cat.\n\n"
               for i in range(400))


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPE, num_key_value_heads=2, vocab_size=PADDED, eos_token_id=0, bos_token_id=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model = write_checkpoint(directory, llama_config(), tokenizer())
    return directory, model


def prepare(tmp_path: Path, tokenizer_spec: str, name: str = "data") -> Path:
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(TEXT)
    out = tmp_path / name
    result = runner.invoke(app, ["prepare", "--input", str(corpus), "--tokenizer", tokenizer_spec, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def data(checkpoint, tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("corpus"), str(checkpoint[0]))


def train(*args):
    return runner.invoke(app, ["train", "--device", "cpu", "--sample-tokens", "0", *args])


FLAGS = ("--ctx", "32", "--batch", "2", "--precision", "fp32")


def losses(run: Path) -> dict[int, float]:
    from trainer.rundir import read_metrics

    return {l["step"]: l["loss"] for l in read_metrics(run, latest=True) if l.get("kind") == "train"}


# ---- the tokenizer ----------------------------------------------------------------------------------------

def test_prepare_with_a_checkpoint_takes_its_end_of_text_and_padded_vocabulary(checkpoint, tmp_path):
    """The checkpoint's config names eos_token_id and an embedding of 320 rows for a 300-token tokenizer.json:
    the corpus records both (the token ids then fit the model as it is), and loads back the same way."""
    from trainer.data import PreparedData

    ck, _ = checkpoint
    cfg = json.loads((ck / "config.json").read_text())
    cfg["eos_token_id"] = 7  # not the <|endoftext|> a tokenizer.json alone would suggest
    other = copy_checkpoint(ck, tmp_path / "eos7")
    (other / "config.json").write_text(json.dumps(cfg))
    for spec in (str(other), str(other / "tokenizer.json")):  # the directory, or its tokenizer.json
        prepared = PreparedData(prepare(tmp_path, spec, name=f"d{len(spec)}"))
        entry = prepared.manifest["tokenizer"]
        assert (entry["vocab_size"], entry["eot_id"]) == (PADDED, 7)
        assert (prepared.vocab_size, prepared.tokenizer.eot_id) == (PADDED, 7)
    plain = PreparedData(prepare(tmp_path, str(_bare_tokenizer(tmp_path)), name="plain"))
    assert plain.manifest["tokenizer"]["vocab_size"] == 300  # a tokenizer.json alone: its own ids, as before


def _bare_tokenizer(tmp_path: Path) -> Path:
    path = tmp_path / "bare" / "tokenizer.json"
    path.parent.mkdir()
    tokenizer().save(str(path))
    return path


# ---- starting from the checkpoint --------------------------------------------------------------------------

def test_a_run_from_a_checkpoint_starts_with_the_logits_transformers_computes(checkpoint, data, tmp_path):
    from memplan.hardware import load_profile
    from memplan.plan import Plan
    from memplan.setup import TrainSetup
    from trainer.data import PreparedData
    from trainer.hf_import import read_spec
    from trainer.loop import Trainer, TrainConfig
    from trainer.task import starting_from_hf

    ck, reference = checkpoint
    _, spec, _, _, _ = read_spec(ck)
    plan = Plan(model=spec, setup=TrainSetup(ctx=32, micro_batch=2, precision="fp32"), device="cpu")
    trainer = Trainer.start(tmp_path / "run", plan, PreparedData(data), TrainConfig(max_steps=1),
                            load_profile("cpu"), starting=starting_from_hf(ck, spec, model_type="llama"))
    try:
        ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            got, want = trainer.model.eval()(ids).float(), reference(ids).logits.float()
        assert (got - want).abs().max().item() < TOL
        assert trainer.base_hf["path"] == str(ck.resolve()) and trainer.record()["base_hf"] == trainer.base_hf
    finally:
        trainer.close()


def test_train_from_trains_records_the_checkpoint_and_exports_back_to_transformers(checkpoint, data, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer import checkpoint_format as ckpt
    from trainer.loop import load_trained

    ck, reference = checkpoint
    run, hf_out = tmp_path / "run", tmp_path / "hf"
    result = train("--from", str(ck), "--data", str(data), "--out", str(run), *FLAGS, "--max-steps", "4")
    assert result.exit_code == 0, result.output
    assert f"from {ck.resolve()} (llama checkpoint" in " ".join(result.output.split())
    meta = ckpt.verify_checkpoint(ckpt.latest_checkpoint(run / "checkpoints").path)
    assert meta["base_hf"]["model_type"] == "llama" and len(meta["base_hf"]["weights_sha256"]) == 64
    assert meta["config"]["lr"] == 1e-4  # continued pretraining's default
    # a model started from the checkpoint: its first loss is the checkpoint's loss on that batch, not a fresh init's
    first = losses(run)[1]
    fresh = train("--data", str(data), "--out", str(tmp_path / "fresh"), "--arch", "llama", "--layers", "2",
                  "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128", *FLAGS, "--max-steps", "1")
    assert fresh.exit_code == 0, fresh.output
    assert abs(first - losses(tmp_path / "fresh")[1]) > 0.1
    exported = runner.invoke(app, ["export", "--run", str(run), "--format", "hf", "--out", str(hf_out)])
    assert exported.exit_code == 0, exported.output
    model = AutoModelForCausalLM.from_pretrained(hf_out).eval()
    tuned, _, _ = load_trained(run)
    ids = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(ids).logits.float() - tuned(ids).float()).abs().max().item() < TOL
        assert (reference(ids).logits - tuned(ids).float()).abs().max().item() > 1e-4  # it trained


def test_the_first_loss_is_the_checkpoints_own_loss_on_the_first_batch(checkpoint, data, tmp_path):
    """End to end: the loss logged at step 1 is transformers' loss for the checkpoint on that step's batch."""
    from trainer.data import PreparedData, TrainStream

    ck, reference = checkpoint
    run = tmp_path / "run"
    result = train("--from", str(ck), "--data", str(data), "--out", str(run), *FLAGS, "--max-steps", "1",
                   "--seed", "5")
    assert result.exit_code == 0, result.output
    x, y = next(iter(TrainStream(PreparedData(data), batch=2, ctx=32, seed=5)))
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(reference(x).logits.float().flatten(0, 1), y.flatten()).item()
    assert losses(run)[1] == pytest.approx(want, abs=1e-4)


@pytest.mark.slow
def test_a_run_from_a_checkpoint_resumes_bit_identically_after_sigkill(checkpoint, data, tmp_path):
    ck, _ = checkpoint
    args = ["--from", str(ck), "--data", str(data), *FLAGS, "--max-steps", "16", "--save-every", "4",
            "--seed", "3", "--sample-tokens", "0", "--device", "cpu"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run_cli(*args, "--out", str(straight)).returncode == 0
    kill_when(args + ["--out", str(killed)], lambda: any(int(p.name.split("-")[1]) >= 8 for p in
                                                          (killed / "checkpoints").glob("step-*")))
    assert 8 <= max(losses(killed)) < 16
    resumed = run_cli("--out", str(killed), "--resume", "--device", "cpu")
    assert resumed.returncode == 0, resumed.stderr
    assert losses(killed) == losses(straight)  # bit for bit


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_starts_again_from_the_checkpoints_weights(checkpoint, data,
                                                                                            tmp_path):
    """No checkpoint yet: --resume starts from step 0 as run.json records the run, from the same checkpoint (its
    weights checked unchanged by sha256), so the losses are the uninterrupted run's; weights changed since are
    refused in one line."""
    ck = copy_checkpoint(checkpoint[0], tmp_path / "ck")
    args = ["--from", str(ck), "--data", str(data), *FLAGS, "--max-steps", "40", "--save-every", "1000",
            "--eval-every", "1000", "--seed", "3", "--sample-tokens", "0", "--device", "cpu"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run_cli(*args, "--out", str(straight)).returncode == 0
    kill_when(args + ["--out", str(killed)], lambda: (killed / "run.json").is_file(), poll=0.001)
    assert not list(killed.glob("checkpoints/step-*"))
    resumed = run_cli("--out", str(killed), "--resume", "--device", "cpu")
    assert resumed.returncode == 0, resumed.stderr
    assert "(llama checkpoint, sha256" in " ".join(resumed.stderr.split())
    assert losses(killed) == losses(straight)
    edit_weights(ck, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"] * 2))
    (killed / "checkpoints").exists() and __import__("shutil").rmtree(killed / "checkpoints")
    refused = run_cli("--out", str(killed), "--resume", "--device", "cpu")
    assert refused.returncode == 2 and "changed since the run started" in refused.stderr


@pytest.mark.slow
def test_a_finetune_from_a_checkpoint_resumes_bit_identically_after_sigkill(checkpoint, tmp_path):
    ck, _ = checkpoint
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Which animal is {i}?", "response": f"The cat is {i}."}) + "\n"
                           for i in range(40)))
    args = ["--from", str(ck), "--data", str(sft), "--ctx", "32", "--batch", "2", "--precision", "fp32",
            "--lora-rank", "4", "--lora-alpha", "8", "--max-steps", "16",
            "--save-every", "4", "--seed", "3", "--sample-tokens", "0", "--device", "cpu"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert run_cli(*args, "--out", str(straight), command="finetune").returncode == 0
    kill_when(args + ["--out", str(killed)], lambda: any(int(p.name.split("-")[1]) >= 8 for p in
                                                          (killed / "checkpoints").glob("step-*")), command="finetune")
    assert 8 <= max(losses(killed)) < 16
    resumed = run_cli("--from", str(ck), "--data", str(sft), "--out", str(killed), "--resume", "--device", "cpu",
                      command="finetune")
    assert resumed.returncode == 0, resumed.stderr
    assert losses(killed) == losses(straight)  # bit for bit


def test_weights_changed_since_a_run_started_are_refused_when_it_starts_again(checkpoint, data, tmp_path):
    from trainer.task import starting_weights_again

    ck = copy_checkpoint(checkpoint[0], tmp_path / "ck")
    from trainer.hf_import import read_spec
    from trainer.task import starting_from_hf

    _, spec, _, _, _ = read_spec(ck)
    record = starting_from_hf(ck, spec, model_type="llama").record
    from memplan.plan import Plan
    from memplan.setup import TrainSetup

    plan = Plan(model=spec, setup=TrainSetup(ctx=32, micro_batch=2, precision="fp32"), device="cpu")
    assert starting_weights_again({"base_hf": record}, "run.json", plan).record == record
    edit_weights(ck, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"] * 2))
    from memplan.errors import InputError

    with pytest.raises(InputError, match="changed since the run started"):
        starting_weights_again({"base_hf": record}, "run.json", plan)
    with pytest.raises(InputError, match="is gone"):
        starting_weights_again({"base_hf": {**record, "path": str(tmp_path / "nowhere")}}, "run.json", plan)


# ---- refusals, one line each -------------------------------------------------------------------------------

def test_a_corpus_prepared_with_another_tokenizer_is_refused(checkpoint, tmp_path):
    ck, _ = checkpoint
    other = prepare(tmp_path, "bpe:300", name="bpe")
    line = one_line_error(train("--from", str(ck), "--data", str(other), "--out", str(tmp_path / "r"), *FLAGS,
                                "--max-steps", "1"))
    assert "another tokenizer" in line and f"--tokenizer {ck}" in line
    bare = prepare(tmp_path, str(_bare_tokenizer(tmp_path)), name="bare-data")  # same tokenizer.json, unpadded ids
    line = one_line_error(train("--from", str(ck), "--data", str(bare), "--out", str(tmp_path / "r"), *FLAGS,
                                "--max-steps", "1"))
    assert "vocabulary of 320" in line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("extra, words", [
    (("--params", "1m"), "not both"),
    (("--layers", "3"), "not both"),
    (("--resume",), "drop --from"),
    (("--ctx", "4096"), "--ctx 4096"),
])
def test_train_from_refusals(checkpoint, data, tmp_path, extra, words):
    ck, _ = checkpoint
    line = one_line_error(train("--from", str(ck), "--data", str(data), "--out", str(tmp_path / "r"), *extra))
    assert words in line
    assert not (tmp_path / "r").exists()


def test_train_from_without_data_names_the_prepare_command(checkpoint, tmp_path):
    ck, _ = checkpoint
    line = one_line_error(train("--from", str(ck), "--out", str(tmp_path / "r")))
    assert "--data" in line and f"memplan prepare --input FILE --tokenizer {ck}" in line


def test_a_hub_id_not_cached_is_fetched_and_offline_the_error_names_the_cache(checkpoint, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = one_line_error(train("--from", "acme/tiny", "--data", "x", "--out", str(tmp_path / "r")))
    assert "HF_HUB_OFFLINE" in line and str(cache) in line
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the fetch fails at once
    (tmp_path / "corpus.txt").write_text(TEXT)
    line = one_line_error(runner.invoke(app, ["prepare", "--input", str(tmp_path / "corpus.txt"), "--tokenizer",
                                              "acme/tiny",
                                              "--out", str(tmp_path / "d")]))
    assert "--tokenizer acme/tiny" in line and "fetching it failed" in line and str(cache) in line


def test_a_hub_id_is_fetched_into_the_cache_then_read_from_it(checkpoint, tmp_path):
    """A local server answering as the Hub does (huggingface_hub's own client, unmodified, against HF_ENDPOINT):
    prepare --tokenizer ID fetches config, tokenizer and safetensors into the cache, never the pickle file the
    repository also holds; train --from ID then reads the cached snapshot with the server gone."""
    import shutil

    repo = copy_checkpoint(checkpoint[0], tmp_path / "repo")
    (repo / "pytorch_model.bin").write_bytes(b"a pickle memplan must never fetch")
    server, requests = hub_server("acme/tiny", repo)
    cache = tmp_path / "cache"
    hub = {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "HF_HUB_CACHE": str(cache),
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "0"}
    (tmp_path / "corpus.txt").write_text(TEXT)
    try:
        prepared = subprocess.run([sys.executable, "-m", "memplan", "prepare", "--input", str(tmp_path / "corpus.txt"),
                                   "--tokenizer", "acme/tiny", "--out", str(tmp_path / "data")],
                                  env={**env(), **hub}, capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
    assert prepared.returncode == 0, prepared.stderr
    assert any(path.endswith("/model.safetensors") for _, path in requests)
    snapshot = next((cache / "models--acme--tiny" / "snapshots").iterdir())
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "generation_config.json",
                                                          "model.safetensors", "tokenizer.json"]
    shutil.rmtree(repo)  # the server and its files are gone: the cache alone serves now
    result = run_cli("--from", "acme/tiny", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"),
                     *FLAGS, "--max-steps", "2", "--sample-tokens", "0", "--device", "cpu",
                     extra_env={**hub, "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "run" / "run.json").read_text())["base_hf"]["path"] == str(snapshot.resolve())


def hub_server(repo_id: str, directory: Path):
    """A Hugging Face Hub endpoint for one repository of ``directory``'s files, on a free local port: the
    revision and tree listings of its API, and HEAD/GET on resolve/ URLs with the commit and ETag headers
    huggingface_hub's client reads. Returns the server (running in a thread) and the requests it received."""
    import hashlib
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import urlparse

    files = {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    commit = hashlib.sha1(b"".join(files[n] for n in sorted(files))).hexdigest()
    requests: list[tuple[str, str]] = []

    class Hub(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def answer(self, head: bool):
            path = urlparse(self.path).path
            requests.append((self.command, path))
            body, headers = b'{"error": "not found"}', {"Content-Type": "application/json",
                                                        "X-Error-Code": "EntryNotFound"}
            code = 404
            if path == f"/api/models/{repo_id}/revision/main":
                code, headers = 200, {"Content-Type": "application/json"}
                body = json.dumps({"id": repo_id, "sha": commit,
                                   "siblings": [{"rfilename": n} for n in files]}).encode()
            elif path.startswith(f"/api/models/{repo_id}/tree/"):
                code, headers = 200, {"Content-Type": "application/json"}
                body = json.dumps([{"type": "file", "path": n, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                   for n, b in files.items()]).encode()
            elif path.startswith(f"/{repo_id}/resolve/{commit}/") and path.rsplit("/", 1)[1] in files:
                body = files[path.rsplit("/", 1)[1]]
                code, headers = 200, {"Content-Type": "application/octet-stream", "X-Repo-Commit": commit,
                                      "ETag": f'"{hashlib.sha1(body).hexdigest()}"'}
            self.send_response(code)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def do_GET(self):
            self.answer(head=False)

        def do_HEAD(self):
            self.answer(head=True)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, requests


# ---- helpers -------------------------------------------------------------------------------------------------

def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}


def run_cli(*args: str, command: str = "train", extra_env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memplan", command, *args], env={**env(), **(extra_env or {})},
                          capture_output=True, text=True, timeout=300)


def kill_when(args: list[str], ready, poll: float = 0.01, command: str = "train") -> None:
    proc = subprocess.Popen([sys.executable, "-m", "memplan", command, *args], env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and not ready():
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(poll)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def test_a_finetune_of_a_from_run_keeps_the_checkpoints_end_of_text(checkpoint, tmp_path):
    """A run trained --from a checkpoint whose config ends text with id 7 (not the <|endoftext|> its tokenizer.json
    also holds): finetuning that run (--run) reads the tokenizer back as the run recorded it, id 7."""
    from trainer import checkpoint_format as ckpt

    ck = copy_checkpoint(checkpoint[0], tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 7}))
    data, run, ft = prepare(tmp_path, str(ck)), tmp_path / "run", tmp_path / "ft"
    assert train("--from", str(ck), "--data", str(data), "--out", str(run), *FLAGS, "--max-steps", "1").exit_code == 0
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"Which animal is {i}?", "response": "The cat."}) + "\n"
                           for i in range(20)))
    result = runner.invoke(app, ["finetune", "--run", str(run), "--data", str(sft), "--out", str(ft), "--ctx", "32",
                                 "--batch", "2", "--max-steps", "1", "--precision", "fp32", "--device", "cpu",
                                 "--sample-tokens", "0"])
    assert result.exit_code == 0, result.output
    meta = ckpt.verify_checkpoint(ckpt.latest_checkpoint(ft / "checkpoints").path)
    assert meta["tokenizer"]["eot_id"] == 7
