"""memplan generate: the KV-cache forward equals the full forward, greedy is deterministic and equals the
cache-less sampler, sampling is reproducible with a seed, the filters do what their papers say, the
window shifts when full, and the CLI streams text to stdout and its stats to stderr.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from memplan.cli import app
from memplan.errors import InputError
from runs_helper import one_line_error, tiny_corpus, tiny_run
from trainer.generate import (GenerationStats, KVCache, SamplingConfig, apply_repetition_penalty,
                              filter_top_k_top_p, forward_cached, generate_ids, repetition_score)
from trainer.loop import load_trained
from trainer.sample import sample_ids

PROMPT = "Story 12. Once upon"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    corpus = tiny_corpus(root)
    return {arch: tiny_run(root / f"run-{arch}", corpus, arch=arch, steps=30) for arch in ("llama", "gpt2")}


def cli(*args):
    return CliRunner().invoke(app, ["generate", *args])



# ---- the cached forward -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_cached_forward_gives_the_full_forwards_logits_at_every_position(runs, arch):
    model, tok, _ = load_trained(runs[arch])
    ids = torch.tensor([tok.encode("Story 7. Once upon a time a fox walked to the river.")] * 2)
    with torch.no_grad():
        full = model(ids).float()  # (B, T, V)
    T = ids.shape[1]
    cache = KVCache(model, batch=2, max_len=T)
    first = forward_cached(model, ids[:, :5], cache, 0)  # prefill 5
    torch.testing.assert_close(first, full[:, 4], atol=1e-5, rtol=1e-5)
    chunk = forward_cached(model, ids[:, 5:8], cache, 5)  # 3 more at once (masked attention over the cache)
    torch.testing.assert_close(chunk, full[:, 7], atol=1e-5, rtol=1e-5)
    for t in range(8, T):  # then one at a time
        step = forward_cached(model, ids[:, t:t + 1], cache, t)
        torch.testing.assert_close(step, full[:, t], atol=1e-5, rtol=1e-5)
    assert cache.length == T


def test_the_cache_is_layers_x_2_x_kv_heads_x_head_dim_x_positions_x_batch_x_bytes(runs):
    model, _, _ = load_trained(runs["llama"])
    spec = model.spec
    cache = KVCache(model, batch=3, max_len=50)
    assert cache.nbytes == spec.layers * 2 * spec.kv_heads * spec.head_dim * 50 * 3 * 4


# ---- greedy and sampling -------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_with_the_cache_chooses_what_the_cacheless_sampler_chooses(runs, arch):
    model, tok, meta = load_trained(runs[arch])
    prompt = tok.encode(PROMPT)
    cached = [t[0] for t in generate_ids(model, prompt, SamplingConfig(max_new_tokens=30, greedy=True,
                                                                       stop_at_eot=False), window=64)]
    plain = sample_ids(model, prompt, 30, ctx=64, greedy=True)
    assert cached == plain


def test_a_batch_of_prompts_generates_what_each_prompt_alone_does(runs):
    model, tok, _ = load_trained(runs["llama"])
    a, b = tok.encode("Story 3. Once"), tok.encode("Story 4. Once")
    assert len(a) == len(b)
    config = SamplingConfig(max_new_tokens=12, greedy=True, stop_at_eot=False)
    together = list(generate_ids(model, [a, b], config, window=64))
    alone_a = [t[0] for t in generate_ids(model, a, config, window=64)]
    alone_b = [t[0] for t in generate_ids(model, b, config, window=64)]
    assert [t[0] for t in together] == alone_a
    assert [t[1] for t in together] == alone_b


def test_a_full_window_keeps_its_newest_half_and_goes_on(runs):
    model, tok, _ = load_trained(runs["llama"])
    prompt = tok.encode(PROMPT)
    window, new = 16, 40
    stats = GenerationStats()
    got = [t[0] for t in generate_ids(model, prompt, SamplingConfig(max_new_tokens=new, greedy=True,
                                                                    stop_at_eot=False),
                                      window=window, stats=stats)]
    # the reference: the model run without a cache on exactly the tokens the cache holds at each step
    max_len, keep = min(window, len(prompt) + new), window // 2
    held, want = list(prompt), []
    with torch.no_grad():
        for _ in range(new):
            nxt = int(model(torch.tensor([held]))[0, -1].argmax())
            want.append(nxt)
            held = (held + [nxt])[-keep:] if len(held) + 1 > max_len else held + [nxt]
    assert got == want
    assert stats.context_shifts >= 2 and stats.new_tokens == new


def test_sampling_is_reproducible_with_a_seed_and_leaves_the_global_rng_alone(runs):
    model, tok, _ = load_trained(runs["llama"])
    prompt = tok.encode(PROMPT)

    def draw(seed):
        c = SamplingConfig(max_new_tokens=25, temperature=1.5, top_k=0, seed=seed, stop_at_eot=False)
        return [t[0] for t in generate_ids(model, prompt, c, window=64)]

    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    first = draw(7)
    after = torch.rand(1)
    assert torch.equal(before, after)  # the sampler drew from its own generator
    assert draw(7) == first
    assert draw(8) != first


def test_top_k_keeps_the_k_largest_and_top_p_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_top_k_top_p(logits, top_k=2, top_p=None)
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    # 0.5 < 0.7 ≤ 0.5 + 0.3: the nucleus of mass 0.7 is the first two tokens
    kept = filter_top_k_top_p(logits, top_k=None, top_p=0.7)
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    kept = filter_top_k_top_p(logits, top_k=None, top_p=0.81)  # 0.8 < 0.81: a third token is needed
    assert torch.isfinite(kept).tolist() == [[True, True, True, False]]
    kept = filter_top_k_top_p(logits, top_k=None, top_p=0.1)  # the most likely token always stays
    assert torch.isfinite(kept).tolist() == [[True, False, False, False]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 3.0]])
    out = apply_repetition_penalty(logits, torch.tensor([[0, 1, 1]]), 2.0)
    assert out.tolist() == [[1.0, -2.0, 3.0]]


def test_repetition_score_is_the_share_of_repeated_4grams():
    assert repetition_score([1, 2, 3, 4, 5, 6]) == 0.0
    assert repetition_score([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 / 5)  # (1,2,3,4) again of 5 4-grams
    assert repetition_score([7] * 10) == pytest.approx(6 / 7)
    assert repetition_score([1, 2, 3]) == 0.0


@pytest.mark.parametrize("kwargs, needle", [
    (dict(temperature=0.0), "--temperature"), (dict(top_p=1.5), "--top-p"), (dict(top_k=-1), "--top-k"),
    (dict(repetition_penalty=0.0), "--repetition-penalty"), (dict(max_new_tokens=-3), "--max-new-tokens"),
])
def test_sampling_config_rejects_bad_values(kwargs, needle):
    with pytest.raises(InputError, match=needle):
        SamplingConfig(**kwargs)


# ---- the command -------------------------------------------------------------------------------------

def test_greedy_prints_the_same_continuation_on_every_call_and_its_stats_on_stderr(runs):
    args = ["--run", str(runs["llama"]), "--prompt", PROMPT, "--greedy", "--max-new-tokens", "20"]
    first, second = cli(*args), cli(*args)
    assert first.exit_code == 0, first.output
    assert first.stdout == second.stdout
    assert first.stdout.strip() and PROMPT not in first.stdout  # the continuation only
    assert "tokens/s" in first.stderr and "repetition" in first.stderr
    assert "tokens/s" not in first.stdout


def test_json_gives_the_text_and_the_stats_and_a_seed_reproduces_a_sample(runs):
    args = ["--run", str(runs["gpt2"]), "--prompt", PROMPT, "--seed", "5", "--top-p", "0.9", "--top-k", "0",
            "--temperature", "1.2", "--repetition-penalty", "1.3", "--max-new-tokens", "30", "--json"]
    a, b = cli(*args), cli(*args)
    assert a.exit_code == 0, a.output
    ja, jb = json.loads(a.stdout), json.loads(b.stdout)
    assert ja["text"] == jb["text"]
    stats = ja["stats"]
    assert stats["prompt_tokens"] > 0 and 0 < stats["new_tokens"] <= 30
    assert 0.0 <= stats["repetition_4gram"] <= 1.0 and stats["tokens_per_second"] > 0
    assert ja["sampling"]["top_p"] == 0.9 and ja["sampling"]["repetition_penalty"] == 1.3


def test_threads_is_accepted_and_leaves_the_greedy_continuation_as_it_is(runs):
    import torch

    args = ["--run", str(runs["llama"]), "--prompt", PROMPT, "--greedy", "--max-new-tokens", "12"]
    before = torch.get_num_threads()
    try:
        one = cli(*args, "--threads", "1")
        assert one.exit_code == 0, one.output
        assert torch.get_num_threads() == 1
        assert one.stdout == cli(*args).stdout
    finally:
        torch.set_num_threads(before)


def test_a_missing_run_is_one_line_naming_it(tmp_path):
    one_line_error(cli("--run", str(tmp_path / "nope"), "--prompt", "x"), "nope", "no such directory")
    (tmp_path / "empty").mkdir()
    one_line_error(cli("--run", str(tmp_path / "empty"), "--prompt", "x"), "empty", "no checkpoint")


def test_bad_sampling_options_are_one_line_errors(runs):
    one_line_error(cli("--run", str(runs["llama"]), "--temperature", "0"), "--temperature")
    one_line_error(cli("--run", str(runs["llama"]), "--top-p", "abc"), "--top-p")


@pytest.mark.parametrize("seed", [str(2**70), str(2**32), "-1"])
def test_a_seed_out_of_range_is_one_line_naming_the_range(runs, seed):
    """torch.manual_seed refuses 2^70 with a traceback; the range is train's (0 to 2^32 - 1)."""
    one_line_error(cli("--run", str(runs["llama"]), "--prompt", "Once", "--max-new-tokens", "2", "--seed", seed),
                   "--seed", "4,294,967,295")
