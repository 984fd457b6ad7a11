"""The generation core: continuous batching equals HF generate, logprobs, seeds, stops, aborts, weight swaps.

Tiny random Llama / Qwen2 models (2 layers, vocab 512). Their weights are
redrawn with std 0.2 so greedy outputs vary with the context (at the default
init a tied tiny model mostly repeats its last token, which would hide cache
bugs).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from areal_core.api.inference import SamplingParams
from areal_core.testing import scaled, wait_until
from areal_local.generator import Finished, Generator, RequestError
from areal_local.models import tiny_model

EOS = 1  # tiny_model's <|im_end|>
PROMPTS = [
    [5, 6, 7],
    list(range(10, 31)),
    [100, 200, 300, 50, 60, 7, 8],
    [42],
    [9, 6, 7, 300, 301, 302, 303, 304, 305, 306, 2],
]


def redraw(model, seed: int):
    """Every matrix ~ N(0, 0.2^2), seeded; norms stay at 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: tiny_model(root / arch, arch=arch, tie_word_embeddings=False) for arch in ("llama", "qwen2")}


def load(folder, seed=0, dtype=torch.float32, attn="sdpa"):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn)
    return redraw(model, seed)


@pytest.fixture(scope="module")
def llama(folders):
    return load(folders["llama"])


@pytest.fixture(scope="module")
def tokenizer(folders):
    return AutoTokenizer.from_pretrained(folders["llama"])


def greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def hf_greedy(model, prompt, n, eos=EOS):
    """HF generate alone on one prompt; tokens after EOS dropped."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=eos
        )[0, len(prompt) :].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


def drain(gen, schedule=None, max_steps=500):
    """Step until idle; ``schedule[s]`` is a list of (rid, prompt, sampling) added before step s."""
    schedule = schedule or {}
    results, busiest = {}, 0
    for s in range(max_steps):
        for rid, prompt, sampling in schedule.get(s, []):
            gen.add(rid, prompt, sampling)
        if not (gen.num_running or gen.num_waiting) and s > max(schedule, default=-1):
            return results, busiest
        for f in gen.step():
            assert f.rid not in results
            results[f.rid] = f
        busiest = max(busiest, gen.num_running)
    raise AssertionError("generator did not drain")


def teacher_forced_logprobs(model, prompt, output, sampling):
    """log p(output[t]) under the warped distribution, from one forward over prompt + output."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    if sampling.temperature > 0:
        logits = TemperatureLogitsWarper(sampling.temperature)(None, logits)
        if sampling.top_k > 0:
            logits = TopKLogitsWarper(sampling.top_k)(None, logits)
        if sampling.top_p < 1:
            logits = TopPLogitsWarper(sampling.top_p)(None, logits)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


# ---------------------------------------------------------------------------
# Greedy equals HF generate under continuous batching
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("qwen2", "sdpa"), ("llama", "eager")])
def test_greedy_matches_hf_generate_with_requests_joining_and_leaving(folders, arch, attn):
    model = load(folders[arch], attn=attn)
    lengths = [14, 5, 12, 9, 16]  # "b" leaves early: its row is refilled while others run
    refs = [hf_greedy(model, p, n) for p, n in zip(PROMPTS, lengths)]
    assert len({tuple(r) for r in refs}) == len(refs)
    gen = Generator(model, eos_token_ids=[EOS], max_batch=3)
    reqs = [(rid, p, greedy(n)) for rid, p, n in zip("abcde", PROMPTS, lengths)]
    # a, b start together; c joins mid-generation; d and e queue behind max_batch=3.
    results, busiest = drain(gen, {0: reqs[:2], 3: [reqs[2]], 4: reqs[3:]})
    assert busiest == 3
    for rid, ref in zip("abcde", refs):
        assert results[rid].output_ids == ref, rid
        assert results[rid].stop_reason == ("stop" if ref[-1] == EOS else "length")
        assert len(results[rid].logprobs) == len(ref)


def test_sliding_window_layers_match_hf_generate():
    config = Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, use_sliding_window=True, sliding_window=6,
        max_window_layers=1, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    assert config.layer_types == ["full_attention", "sliding_attention"]
    torch.manual_seed(0)
    model = redraw(Qwen2ForCausalLM(config), 3)
    refs = [hf_greedy(model, p, 10, eos=None) for p in PROMPTS[:3]]
    gen = Generator(model, eos_token_ids=[])
    schedule = {0: [("a", PROMPTS[0], greedy(10)), ("b", PROMPTS[1], greedy(10))], 2: [("c", PROMPTS[2], greedy(10))]}
    results, _ = drain(gen, schedule)
    assert [results[r].output_ids for r in "abc"] == refs


# ---------------------------------------------------------------------------
# Logprobs and seeds
# ---------------------------------------------------------------------------


def test_logprobs_equal_a_teacher_forced_pass_under_the_same_warping(llama):
    settings = {
        "greedy": greedy(12),
        "temp": SamplingParams(max_new_tokens=12, temperature=0.7, seed=1),
        "topk": SamplingParams(max_new_tokens=12, temperature=1.3, top_k=5, seed=2),
        "topp": SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.6, seed=3),
        "both": SamplingParams(max_new_tokens=12, temperature=1.0, top_k=40, top_p=0.8, seed=4),
        # flat: the 256 most likely of 512 tokens hold less than top_p, so the whole row is sorted
        "flat": SamplingParams(max_new_tokens=12, temperature=20.0, top_p=0.95, seed=5),
    }
    gen = Generator(llama, eos_token_ids=[])
    prompts = dict(zip(settings, PROMPTS + PROMPTS))
    results, _ = drain(gen, {0: [(rid, prompts[rid], s) for rid, s in settings.items()]})
    for rid, sampling in settings.items():
        out = results[rid]
        ref = teacher_forced_logprobs(llama, prompts[rid], out.output_ids, sampling)
        assert torch.isfinite(ref).all(), f"{rid}: sampled a token the warpers remove"
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0), rid
    assert results["greedy"].output_ids == hf_greedy(llama, PROMPTS[0], 12, eos=None)


def test_same_seed_same_tokens_alone_or_in_any_batch(llama):
    sampling = SamplingParams(max_new_tokens=20, temperature=1.0, seed=1234)
    alone, _ = drain(Generator(llama, eos_token_ids=[]), {0: [("x", PROMPTS[1], sampling)]})
    others = [(f"o{i}", p, SamplingParams(max_new_tokens=7 + i, seed=i)) for i, p in enumerate(PROMPTS)]
    crowded, busiest = drain(
        Generator(llama, eos_token_ids=[], max_batch=4),
        {0: others[:3], 2: [("x", PROMPTS[1], sampling)], 5: others[3:]},
    )
    assert busiest == 4
    assert crowded["x"].output_ids == alone["x"].output_ids
    assert crowded["x"].logprobs == pytest.approx(alone["x"].logprobs, abs=1e-5)
    other_seed, _ = drain(
        Generator(llama, eos_token_ids=[]), {0: [("x", PROMPTS[1], SamplingParams(max_new_tokens=20, seed=99))]}
    )
    assert other_seed["x"].output_ids != alone["x"].output_ids


def test_repeated_prompts_are_prefilled_once_and_sample_like_separate_ones(llama):
    # A GRPO group: the same prompt several times with different seeds, mixed with other prompts and a
    # repeat that arrives later (a continuation shares nothing with its prompt's first prefill).
    group = [(f"g{i}", PROMPTS[1], SamplingParams(max_new_tokens=10, seed=i)) for i in range(4)]
    others = [("a", PROMPTS[2], SamplingParams(max_new_tokens=10, seed=7)), ("b", PROMPTS[2], greedy(10))]
    shared_gen = Generator(llama, eos_token_ids=[])
    rows = []
    original = shared_gen._forward
    shared_gen._forward = lambda ids, *a: rows.append(ids.shape[0]) or original(ids, *a)
    shared, _ = drain(shared_gen, {0: group + others, 3: [("late", PROMPTS[1], greedy(10))]})
    assert rows[0] == 2  # the first forward prefilled two distinct prompts for six requests
    for rid, prompt, sampling in group + others + [("late", PROMPTS[1], greedy(10))]:
        alone, _ = drain(Generator(llama, eos_token_ids=[]), {0: [(rid, prompt, sampling)]})
        assert shared[rid].output_ids == alone[rid].output_ids, rid
        assert shared[rid].logprobs == pytest.approx(alone[rid].logprobs, abs=1e-5), rid
    assert len({tuple(shared[f"g{i}"].output_ids) for i in range(4)}) > 1  # seeds still differ per request


HEADER = [7, 300, 301, 12, 13, 99, 98, 97, 400, 401, 402, 5, 6, 7, 8, 9, 250, 251, 252, 253]  # a few-shot header


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_prompt_prefix_shared_by_the_joiners_runs_once_and_changes_no_token(folders, arch):
    model = load(folders[arch], seed=3)
    tails = [[30, 31], list(range(40, 49)), [60], [70, 71, 72, 73], list(range(80, 86)), [90, 91, 92]]
    prompts = [HEADER + t for t in tails]
    joined = [(f"p{i}", p, greedy(8)) for i, p in enumerate(prompts)]
    joined += [(f"s{i}", prompts[1], SamplingParams(max_new_tokens=8, seed=i)) for i in range(3)]  # a GRPO group
    late = [("late0", HEADER + [5, 5], greedy(8)), ("late1", HEADER + [6, 6, 6], greedy(8)),
            ("late2", HEADER[:12] + [1, 2], greedy(8))]
    gen = Generator(model, eos_token_ids=[])
    seen: list[tuple[int, int]] = []
    original = gen._forward
    gen._forward = lambda ids, *a, **kw: seen.append(tuple(ids.shape)) or original(ids, *a, **kw)
    shared, _ = drain(gen, {0: joined, 2: late})
    # Step 0: the header once, then the six distinct prompts from the column where the longest tail starts
    # (the others recompute a little of their copy of the header), then the decode step.
    assert seen[0] == (1, len(HEADER))
    assert seen[1] == (6, max(map(len, tails)))
    # Step 2: the late joiners share 12 header tokens, too few to save 64 tokens: one plain prefill.
    assert (3, len(HEADER) + 3) in seen
    for rid, prompt, sampling in joined + late:
        alone, _ = drain(Generator(model, eos_token_ids=[]), {0: [(rid, prompt, sampling)]})
        assert shared[rid].output_ids == alone[rid].output_ids, rid
        assert shared[rid].logprobs == pytest.approx(alone[rid].logprobs, abs=1e-5), rid


def test_the_shared_prefix_is_run_only_when_it_saves_enough(llama):
    gen = Generator(llama, eos_token_ids=[])
    few = [gen._validate(f"a{i}", HEADER[:7] + [i + 3] * 40, greedy(2)) for i in range(20)]
    assert gen._shared_prefix(few) is None  # 7 common tokens: below the 8-token floor
    two = [gen._validate(f"b{i}", HEADER + [i + 3], greedy(2)) for i in range(2)]
    assert gen._shared_prefix(two) is None  # 20 tokens saved once: below the 64-token floor
    same = [gen._validate(f"c{i}", HEADER, greedy(2)) for i in range(8)]
    assert gen._shared_prefix(same) is None  # identical prompts are deduplicated instead
    five = [gen._validate(f"d{i}", HEADER + [i + 3, 4], greedy(2)) for i in range(5)]
    common, cache = gen._shared_prefix(five)
    assert common == len(HEADER) and cache.keys[0].shape[2] == len(HEADER)


def test_a_failing_shared_prefix_forward_puts_every_joiner_back(llama, monkeypatch):
    prompts = [HEADER + [i + 3] for i in range(6)]
    refs = [hf_greedy(llama, p, 5, eos=None) for p in prompts]
    gen = Generator(llama, eos_token_ids=[])
    for i, p in enumerate(prompts):
        gen.add(f"r{i}", p, greedy(5))
    with monkeypatch.context() as patch:
        patch.setattr(gen, "_forward", lambda *a, **kw: (_ for _ in ()).throw(MemoryError("no room")))
        with pytest.raises(MemoryError):
            gen.step()
    assert (gen.num_running, gen.num_waiting) == (0, 6)
    results, _ = drain(gen)
    assert [results[f"r{i}"].output_ids for i in range(6)] == refs


# ---------------------------------------------------------------------------
# Stops
# ---------------------------------------------------------------------------


def test_max_new_tokens_stops_with_length(llama):
    schedule = {0: [("a", PROMPTS[0], greedy(1)), ("b", PROMPTS[1], greedy(7))]}
    results, _ = drain(Generator(llama, eos_token_ids=[]), schedule)
    assert [len(results[r].output_ids) for r in "ab"] == [1, 7]
    assert {results[r].stop_reason for r in "ab"} == {"length"}


def test_stop_token_ids_and_eos_stop_with_the_token_kept(llama):
    ref = hf_greedy(llama, PROMPTS[2], 16, eos=None)
    stop_at = next(i for i in range(3, 16) if ref[i] not in ref[:i])
    token = ref[stop_at]
    schedule = {0: [("a", PROMPTS[2], greedy(16, stop_token_ids=(token,)))]}
    results, _ = drain(Generator(llama, eos_token_ids=[]), schedule)
    assert results["a"] == Finished("a", ref[: stop_at + 1], results["a"].logprobs, "stop")
    results, _ = drain(Generator(llama, eos_token_ids=[token]), {0: [("a", PROMPTS[2], greedy(16))]})
    assert (results["a"].output_ids, results["a"].stop_reason) == (ref[: stop_at + 1], "stop")


def test_stop_string_ends_at_the_token_that_completes_it(llama, tokenizer):
    prompt = PROMPTS[4]
    ref = hf_greedy(llama, prompt, 24, eos=None)
    # A stop string spanning the end of token k-1 and the start of token k's text, not seen before token k.
    for k in range(4, 24):
        text, before = tokenizer.decode(ref[: k + 1]), tokenizer.decode(ref[:k])
        stop = text[len(before) - 2 : len(before) + 2] if text.startswith(before) else ""
        if len(stop) == 4 and "\ufffd" not in stop and stop not in before:
            break
    else:
        pytest.skip("no clean stop string in this output")
    gen = Generator(llama, eos_token_ids=[], decode_fn=tokenizer.decode)
    results, _ = drain(gen, {0: [("a", prompt, greedy(24, stop=("never-there", stop))), ("b", prompt, greedy(24))]})
    assert results["a"].output_ids == ref[: k + 1] and results["a"].stop_reason == "stop"
    assert results["b"].output_ids == ref  # the same prompt without stop strings runs on


# ---------------------------------------------------------------------------
# Bad requests
# ---------------------------------------------------------------------------


def test_bad_requests_raise_exact_errors_and_leave_a_running_request_alone(llama):
    ref = hf_greedy(llama, PROMPTS[1], 12, eos=None)
    gen = Generator(llama, eos_token_ids=[], max_seq_len=64)
    gen.add("good", PROMPTS[1], greedy(12))
    gen.step()
    gen.step()
    bad = {
        "request 'e': input_ids is empty; a prompt needs at least 1 token": ("e", [], greedy(4)),
        "request 'n': sampling.max_new_tokens is 0; it must be at least 1": ("n", [3], greedy(0)),
        "request 'l': the prompt has 64 tokens; max_seq_len is 64, so a prompt may have at most 63 tokens": (
            "l", [3] * 64, greedy(1)),
        "request 's': the prompt (60 tokens) + sampling.max_new_tokens (5) = 65 exceeds max_seq_len 64; "
        "max_new_tokens may be at most 4 for this prompt": ("s", [3] * 60, greedy(5)),
        "request 'v': input_ids[2] = 512 is outside the vocabulary [0, 512)": ("v", [3, 4, 512], greedy(4)),
        "request 'm': input_ids[0] = -1 is outside the vocabulary [0, 512)": ("m", [-1], greedy(4)),
        "request 'good' is already running or waiting; request ids must be unique among live requests": (
            "good", [3], greedy(4)),
        "request 't': sampling.temperature is -0.5; it must be a finite number >= 0 (0 = greedy)": (
            "t", [3], SamplingParams(4, temperature=-0.5)),
        "request 'p': sampling.top_p is 0.0; it must be in (0, 1]": ("p", [3], SamplingParams(4, top_p=0.0)),
        "request 'k': sampling.top_k is 0; it must be -1 (off) or at least 1": ("k", [3], SamplingParams(4, top_k=0)),
        "request 'x': sampling.stop is ('###',) but this Generator has no decode_fn to turn tokens into text; "
        "build it with decode_fn=tokenizer.decode": ("x", [3], SamplingParams(4, stop=("###",))),
    }
    for message, (rid, prompt, sampling) in bad.items():
        with pytest.raises(RequestError) as info:
            gen.add(rid, prompt, sampling)
        assert str(info.value) == message
    assert (gen.num_running, gen.num_waiting) == (1, 0)
    results, _ = drain(gen)
    assert results["good"].output_ids == ref
    gen.add("good", PROMPTS[0], greedy(2))  # a finished id may be reused
    assert gen.num_waiting == 1


# ---------------------------------------------------------------------------
# Aborts
# ---------------------------------------------------------------------------


def test_abort_all_returns_partial_outputs_that_continue_to_the_uninterrupted_result(llama):
    n = 15
    refs = {rid: hf_greedy(llama, p, n, eos=None) for rid, p in zip("abc", PROMPTS)}
    gen = Generator(llama, eos_token_ids=[], max_batch=2)
    for rid, p in zip("abc", PROMPTS):
        gen.add(rid, p, greedy(n))
    for _ in range(4):
        assert gen.step() == []
    aborted = {f.rid: f for f in gen.abort_all()}
    assert (gen.num_running, gen.num_waiting) == (0, 0)
    assert {f.stop_reason for f in aborted.values()} == {"abort"}
    assert aborted["c"].output_ids == []  # still waiting behind max_batch=2
    for rid in "ab":
        partial = aborted[rid].output_ids
        assert 0 < len(partial) < n and partial == refs[rid][: len(partial)]
    for rid, p in zip("abc", PROMPTS):  # continue from prompt + partial
        gen.add(rid, p + aborted[rid].output_ids, greedy(n - len(aborted[rid].output_ids)))
    results, _ = drain(gen)
    for rid in "abc":
        assert aborted[rid].output_ids + results[rid].output_ids == refs[rid]


def test_abort_one_request_leaves_the_others_running(llama):
    refs = [hf_greedy(llama, p, 10, eos=None) for p in PROMPTS[:3]]
    gen = Generator(llama, eos_token_ids=[])
    for rid, p in zip("abc", PROMPTS):
        gen.add(rid, p, greedy(10))
    gen.step()
    out = gen.abort("a")  # row 0: the last row moves into its place
    assert out.stop_reason == "abort" and out.output_ids == refs[0][:2]
    assert gen.abort("a") is None and gen.abort("nope") is None
    results, _ = drain(gen)
    assert [results["b"].output_ids, results["c"].output_ids] == refs[1:]


def test_a_failing_prefill_forward_puts_the_joiners_back_in_the_queue(llama, monkeypatch):
    refs = [hf_greedy(llama, p, 6, eos=None) for p in PROMPTS[:3]]
    gen = Generator(llama, eos_token_ids=[])
    gen.add("a", PROMPTS[0], greedy(6))
    gen.step()
    gen.add("b", PROMPTS[1], greedy(6))
    gen.add("c", PROMPTS[2], greedy(6))
    with monkeypatch.context() as patch:
        patch.setattr(gen, "_forward", lambda *a: (_ for _ in ()).throw(MemoryError("no room")))
        with pytest.raises(MemoryError):
            gen.step()
    assert (gen.num_running, gen.num_waiting) == (1, 2)
    results, _ = drain(gen)
    assert [results[r].output_ids for r in "abc"] == refs


# ---------------------------------------------------------------------------
# Weight swaps
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("packed, workers, defer", [(None, 1, False), (None, 2, False), (False, 2, False),
                                                    (None, 2, True)],
                         ids=["packed", "packed-two-load-workers", "plain-two-load-workers", "rebuilt-in-background"])
def test_load_state_dict_generates_with_the_new_weights_only(folders, packed, workers, defer):
    old, new = load(folders["llama"], seed=0), load(folders["llama"], seed=1)
    prompt, n = PROMPTS[2], 12
    ref_old, ref_new = hf_greedy(old, prompt, n, eos=None), hf_greedy(new, prompt, n, eos=None)
    assert ref_old != ref_new
    gen = Generator(load(folders["llama"], seed=0), eos_token_ids=[], packed_linears=packed, load_workers=workers,
                    defer_derived=defer)
    assert drain(gen, {0: [("a", prompt, greedy(n))]})[0]["a"].output_ids == ref_old

    # In flight: the request keeps its tokens so far and continues under the new weights.
    gen.add("b", prompt, greedy(n))
    gen.step()
    gen.step()
    gen.load_state_dict(new.state_dict())
    assert (gen.num_running, gen.num_waiting) == (0, 1)
    partial = ref_old[:3]
    results, _ = drain(gen)
    assert results["b"].output_ids[:3] == partial
    assert results["b"].output_ids == partial + hf_greedy(new, prompt + partial, n - 3, eos=None)
    assert drain(gen, {0: [("c", prompt, greedy(n))]})[0]["c"].output_ids == ref_new


class HeldRebuild:
    """Test double around a generator's derived-copy jobs: each waits for :attr:`release` before it runs (or
    raises ``fail`` instead), so a test can step while a background rebuild is under way."""

    def __init__(self, gen, monkeypatch, fail: BaseException | None = None) -> None:
        import threading

        self.release, self.fail = threading.Event(), fail
        packed_jobs, lean_jobs = gen._packed.jobs, gen._lean.jobs

        def hold(job):
            def run():
                assert self.release.wait(scaled(60)), "the test never released the rebuild"
                if self.fail is not None:
                    raise self.fail
                job()
            return run

        monkeypatch.setattr(gen._packed, "jobs", lambda: [(n, hold(job)) for n, job in packed_jobs()])

        def lean():
            jobs, finish = lean_jobs()
            return [(n, hold(job)) for n, job in jobs], finish

        monkeypatch.setattr(gen._lean, "jobs", lean)


def test_a_background_rebuild_is_never_read_before_it_ends_and_a_load_waits_for_it(folders, monkeypatch):
    """defer_derived: after a load the packed copies (and the lean decoder's fused ones) still hold the old
    weights until the rebuild's jobs run; steps meanwhile must come from the new weights themselves, the copies
    go in use once rebuilt (byte for byte a fresh generator's), and a load waits for a rebuild under way."""
    import threading

    from areal_local.packed import _memory_of

    def packed_bytes(packed):  # the packed copy's memory as laid out (to_dense would hide the layout)
        return _memory_of(packed).clone()

    old, new, newer = (load(folders["llama"], seed=s) for s in (0, 1, 2))
    prompt, n = PROMPTS[2], 10
    ref_new, ref_newer = hf_greedy(new, prompt, n, eos=None), hf_greedy(newer, prompt, n, eos=None)
    assert hf_greedy(old, prompt, n, eos=None) != ref_new != ref_newer
    gen = Generator(load(folders["llama"], seed=0), eos_token_ids=[], load_workers=2, defer_derived=True)
    assert gen._packed is not None and gen._lean is not None and gen._lean.packed
    held = HeldRebuild(gen, monkeypatch)
    gen.load_state_dict(new.state_dict())
    assert gen.rebuilding and gen.background_rebuild_s is None
    results, _ = drain(gen, {0: [("a", prompt, greedy(n))]})  # every step inside the rebuild: the old copies
    assert results["a"].output_ids == ref_new                 # were never read
    assert gen.rebuilding
    # A load waits for the rebuild under way (its jobs read the weights the load replaces)
    loading = threading.Thread(target=gen.load_state_dict, args=(newer.state_dict(),))
    loading.start()
    loading.join(0.3)
    assert loading.is_alive()
    held.release.set()
    loading.join(scaled(60))
    assert not loading.is_alive()
    wait_until(lambda: not gen.rebuilding, 60, "the background rebuild to end", 0.01)
    assert gen.background_rebuild_s is not None and gen.background_rebuild_s > 0
    results, _ = drain(gen, {0: [("b", prompt, greedy(n))]})  # the first step puts the rebuilt copies in use
    assert results["b"].output_ids == ref_newer and gen._derived_live and gen._packed.live
    want = Generator(newer, eos_token_ids=[])
    for mine, theirs in zip(gen._packed.modules, want._packed.modules, strict=True):
        assert torch.equal(packed_bytes(gen._packed.weight_of(mine)), packed_bytes(want._packed.weight_of(theirs)))
    for (mine, _), (theirs, _) in zip(gen._lean._qkv, want._lean._qkv, strict=True):
        assert torch.equal(packed_bytes(mine), packed_bytes(theirs))


def test_a_background_rebuild_that_fails_is_never_read_and_fails_the_next_load(folders, monkeypatch):
    new = load(folders["llama"], seed=1)
    prompt, n = PROMPTS[2], 10
    gen = Generator(load(folders["llama"], seed=0), eos_token_ids=[], load_workers=2, defer_derived=True)
    held = HeldRebuild(gen, monkeypatch, fail=MemoryError("no room for a packed copy"))
    gen.load_state_dict(new.state_dict())
    held.release.set()
    wait_until(lambda: not gen.rebuilding, 60, "the background rebuild to end", 0.01)
    results, _ = drain(gen, {0: [("a", prompt, greedy(n))]})  # half-rebuilt copies: steps stay on the weights
    assert results["a"].output_ids == hf_greedy(new, prompt, n, eos=None) and not gen._derived_live
    with pytest.raises(RuntimeError, match="the background rebuild of the derived copies failed: MemoryError: "
                                           "no room for a packed copy"):
        gen.load_state_dict(new.state_dict())
    held.fail = None
    gen.load_state_dict(new.state_dict())  # the error was raised once; this load rebuilds again
    gen.settle()
    assert gen._derived_live and drain(gen, {0: [("b", prompt, greedy(n))]})[0]["b"].output_ids == \
        hf_greedy(new, prompt, n, eos=None)


def test_defer_derived_needs_load_workers(llama):
    with pytest.raises(ValueError, match="defer_derived needs load_workers > 1"):
        Generator(llama, eos_token_ids=[], defer_derived=True)


def test_load_safetensors_dir_and_refusals_leave_the_weights_alone(folders, tmp_path):
    new = load(folders["llama"], seed=1)
    new.save_pretrained(tmp_path / "new")
    gen = Generator(load(folders["llama"], seed=0), eos_token_ids=[])
    before = {k: v.clone() for k, v in gen.model.state_dict().items()}
    state = new.state_dict()
    wrong = dict(state, **{"model.norm.weight": torch.ones(3)})
    refused = r"refused, nothing was loaded: 'model.norm.weight' has shape \(3,\), the model's is \(64,\)"
    with pytest.raises(ValueError, match=refused):
        gen.load_state_dict(wrong)
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\): 'lm_head.weight'"):
        gen.load_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match=r"'model.extra' is not a weight of LlamaForCausalLM"):
        gen.load_state_dict(dict(state, **{"model.extra": torch.zeros(1)}))
    assert all(torch.equal(before[k], v) for k, v in gen.model.state_dict().items())
    with pytest.raises(ValueError, match="no \\*.safetensors file in"):
        gen.load_safetensors_dir(tmp_path)
    gen.load_safetensors_dir(tmp_path / "new")
    assert all(torch.equal(state[k], v) for k, v in gen.model.state_dict().items())
    assert drain(gen, {0: [("a", PROMPTS[0], greedy(8))]})[0]["a"].output_ids == hf_greedy(new, PROMPTS[0], 8, eos=None)


@pytest.mark.parametrize("adopt", [False, True], ids=["copied", "adopted"])
def test_the_shm_stage_loads_bit_exact_and_a_half_written_one_changes_nothing(folders, tmp_path, adopt):
    """Weights through the /dev/shm stage (areal_local.shm) land in the parameters bit for bit (copied in, or
    served from the slot as they are), version after version through the mappings the generator keeps; a
    stage whose write failed half way, or that holds another version, is refused before anything changes."""
    from areal_local.shm import IncompleteWeights, WeightStage

    gen = Generator(load(folders["llama"], seed=0), eos_token_ids=[])
    stage = WeightStage(tmp_path)
    for version, seed in ((1, 1), (2, 2)):
        sent = {k: v.clone() for k, v in load(folders["llama"], seed=seed).state_dict().items()}
        folder = stage.write(sent.items(), version)
        gen.load_safetensors_dir(folder, version, adopt=adopt)
        held = gen.model.state_dict()
        assert all(torch.equal(held[k].view(torch.uint8), v.view(torch.uint8)) for k, v in sent.items())
        assert set(gen.load_phases) == {"read", "checked", "copied", "derived"}
        assert bool(gen.adopted) == adopt
    expected = drain(gen, {0: [("a", PROMPTS[0], greedy(6))]})[0]["a"].output_ids
    before = {k: v.clone() for k, v in gen.model.state_dict().items()}
    with pytest.raises(IncompleteWeights, match="holds version 2, not the version 3"):
        gen.load_safetensors_dir(folder, 3, adopt=adopt)
    other = stage.slot_folder(0)  # version 1's slot: a write of version 3 into it that failed half way
    (other / "model.safetensors").open("r+b").write(bytes(8))
    with pytest.raises(IncompleteWeights, match="never finished"):
        gen.load_safetensors_dir(other, 3, adopt=adopt)
    assert all(torch.equal(before[k], v) for k, v in gen.model.state_dict().items())
    assert drain(gen, {0: [("b", PROMPTS[0], greedy(6))]})[0]["b"].output_ids == expected
    stage.close()


def _views_of(tensor: torch.Tensor, folder) -> bool:
    """Whether ``tensor``'s memory lies inside the mapping of ``folder``'s stage file in this process."""
    start = tensor.data_ptr()
    for line in open("/proc/self/maps"):
        parts = line.split()
        if len(parts) >= 6 and parts[5] == str(folder / "model.safetensors"):
            low, high = (int(x, 16) for x in parts[0].split("-"))
            if low <= start < high:
                return True
    return False


def test_adopted_weights_are_served_from_their_slot_while_the_next_version_goes_into_the_other(folders, tmp_path):
    """The stage's two slots in turn: a version adopted from one slot is served from that mapping (no copy),
    the next version is written into the other slot while the generator still serves the first unchanged,
    and loading it moves every weight over; tokens equal HF's greedy under each version."""
    from areal_local.shm import WeightStage

    gen = Generator(load(folders["llama"], seed=0), eos_token_ids=[])
    stage = WeightStage(tmp_path)
    v1, v2 = load(folders["llama"], seed=1), load(folders["llama"], seed=2)
    first = stage.write(list(v1.state_dict().items()), 1)
    gen.load_safetensors_dir(first, 1, adopt=True)
    params = dict(gen.model.named_parameters())
    assert params and all(_views_of(p, first) for p in params.values())
    tokens_v1 = drain(gen, {0: [("a", PROMPTS[0], greedy(6))]})[0]["a"].output_ids
    assert tokens_v1 == hf_greedy(v1, PROMPTS[0], 6, eos=None)
    second = stage.write(list(v2.state_dict().items()), 2)
    assert second != first and second.parent == first.parent
    assert drain(gen, {0: [("b", PROMPTS[0], greedy(6))]})[0]["b"].output_ids == tokens_v1  # untouched
    gen.load_safetensors_dir(second, 2, adopt=True)
    assert all(_views_of(p, second) for p in gen.model.parameters())
    assert drain(gen, {0: [("c", PROMPTS[0], greedy(6))]})[0]["c"].output_ids == hf_greedy(v2, PROMPTS[0], 6, eos=None)
    assert stage.write(list(v1.state_dict().items()), 3) == first  # version 3 goes back to the first slot
    stage.close()


def test_anything_that_is_not_a_whole_adopted_version_is_copied_into_the_models_own_memory(folders, tmp_path):
    """After an adopted load: a partial adopted load from the other slot copies the weights it leaves out back
    into the model's own memory (the first slot will be rewritten); a disk folder is copied in; a delta copies
    every adopted weight out first and never writes into the slot. Each time the weights are bit for bit
    what was sent and the memory is what the model had before it adopted anything."""
    from safetensors.torch import load_file, save_file

    from areal_core.weight_delta import delta_to_named, make_delta
    from areal_local.shm import WeightStage

    gen = Generator(load(folders["llama"], seed=0), eos_token_ids=[])
    own = {name: p.data_ptr() for name, p in gen.model.named_parameters()}
    (tmp_path / "stage").mkdir()
    stage = WeightStage(tmp_path / "stage")
    v1 = {k: v.clone() for k, v in load(folders["llama"], seed=1).state_dict().items()}
    v2 = {k: v.clone() for k, v in load(folders["llama"], seed=2).state_dict().items()}

    def check(expected: dict) -> None:
        held = gen.model.state_dict()
        assert all(torch.equal(held[k], v) for k, v in expected.items())

    first = stage.write(v1.items(), 1)
    gen.load_safetensors_dir(first, 1, adopt=True)
    part = {k: v for k, v in v2.items() if ".layers.0." in k}
    second = stage.write(part.items(), 2)  # another layout: a new stage folder, both slots new
    gen.load_safetensors_dir(second, 2, strict=False, adopt=True)
    assert gen.adopted == frozenset(part)
    check({**v1, **part})
    left = [name for name in own if name not in part]
    assert left and all(gen.model.get_parameter(n).data_ptr() == own[n] for n in left)

    save_file(v1, str(tmp_path / "model.safetensors"))
    gen.load_safetensors_dir(tmp_path)  # a disk folder: copied
    assert not gen.adopted and {n: p.data_ptr() for n, p in gen.model.named_parameters()} == own
    check(v1)

    third = stage.write(v1.items(), 3)
    gen.load_safetensors_dir(third, 3, adopt=True)
    assert gen.adopted
    slot_before = load_file(str(third / "model.safetensors"))
    changed = {k: v.clone() for k, v in v1.items()}
    changed["model.norm.weight"][:3] += 1.0
    delta_folder = tmp_path / "delta"
    delta_folder.mkdir()
    save_file(dict(delta_to_named(make_delta(v1, list(changed.items()), 3, 4))), str(delta_folder / "d.safetensors"))
    gen.load_delta_dir(delta_folder, 3, 4)
    assert not gen.adopted and {n: p.data_ptr() for n, p in gen.model.named_parameters()} == own
    check(changed)
    slot_after = load_file(str(third / "model.safetensors"))
    assert all(torch.equal(slot_before[k], slot_after[k]) for k in slot_before)

    gen.load_safetensors_dir(stage.write(v2.items(), 5), 5, adopt=True)
    assert gen.adopted
    some = {k: v for k, v in v1.items() if ".layers.1." in k}
    (tmp_path / "partial").mkdir()
    save_file(some, str(tmp_path / "partial" / "model.safetensors"))
    gen.load_safetensors_dir(tmp_path / "partial", strict=False)  # a partial disk load: nothing stays a view
    assert not gen.adopted and {n: p.data_ptr() for n, p in gen.model.named_parameters()} == own
    check({**v2, **some})
    stage.close()


# ---------------------------------------------------------------------------
# bfloat16
# ---------------------------------------------------------------------------


def test_bfloat16_smoke(folders):
    model = load(folders["qwen2"], dtype=torch.bfloat16)
    gen = Generator(model, eos_token_ids=[])
    results, busiest = drain(
        gen,
        {0: [("g", PROMPTS[0], greedy(8)), ("s", PROMPTS[1], SamplingParams(max_new_tokens=8, seed=0, top_p=0.9))],
         1: [("t", PROMPTS[2], SamplingParams(max_new_tokens=8, temperature=0.5, top_k=3, seed=1))]},
    )
    assert busiest == 3
    for f in results.values():
        assert len(f.output_ids) == 8 and all(0 <= t < 512 for t in f.output_ids)
        assert all(math.isfinite(x) and x <= 1e-6 for x in f.logprobs)
    ref = teacher_forced_logprobs(model, PROMPTS[0], results["g"].output_ids, greedy(8))
    assert torch.allclose(torch.tensor(results["g"].logprobs), ref, atol=0.1)


# ---------------------------------------------------------------------------
# oneDNN-prepacked linears (the default on CPU)
# ---------------------------------------------------------------------------


def test_packed_linears_are_the_default_and_agree_with_torchs_own_kernels(folders):
    from areal_local.packed import packing_available

    model = load(folders["qwen2"], seed=3)  # qwen2: the q/k/v biases go through the packed path too
    with torch.no_grad():
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        assert biases
        for b in biases:
            b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(b.numel())) * 0.5)
    assert packing_available(model)
    schedule = {0: [(f"r{i}", p, SamplingParams(max_new_tokens=12, seed=i)) for i, p in enumerate(PROMPTS)]}
    packed_gen = Generator(model, eos_token_ids=[])
    assert packed_gen._packed is not None
    packed, _ = drain(packed_gen, schedule)
    packed_gen._packed.detach()
    plain, _ = drain(Generator(model, eos_token_ids=[], packed_linears=False), schedule)
    for rid in plain:
        assert packed[rid].output_ids == plain[rid].output_ids
        assert max(abs(a - b) for a, b in zip(packed[rid].logprobs, plain[rid].logprobs)) < 1e-4


def test_a_weight_load_repacks_in_place_bit_exact_with_fresh_packing(folders):
    """After a load the packed and fused copies are rewritten in the tensors already there (areal_local.packed.repack),
    and they are bit for bit what packing the new weights afresh gives: the same tokens and logprobs as a new
    generator built on the new weights."""
    model = load(folders["qwen2"], seed=3)
    gen = Generator(model, eos_token_ids=[])
    packed_before = dict(gen._packed._packed)
    qkv_before = [w for w, _ in gen._lean._qkv]
    new = load(folders["qwen2"], seed=4)
    gen.load_state_dict(new.state_dict())
    assert all(gen._packed._packed[k] is t for k, t in packed_before.items())
    assert all(w is was for (w, _), was in zip(gen._lean._qkv, qkv_before))
    fresh = Generator(new, eos_token_ids=[])
    for mine, theirs in zip(gen._packed.modules, fresh._packed.modules, strict=True):
        assert torch.equal(gen._packed.weight_of(mine).to_dense(), fresh._packed.weight_of(theirs).to_dense())
    for (mine, mine_bias), (theirs, theirs_bias) in zip(gen._lean._qkv, fresh._lean._qkv):
        assert torch.equal(mine.to_dense(), theirs.to_dense()) and torch.equal(mine_bias, theirs_bias)
    schedule = {0: [(f"r{i}", p, SamplingParams(max_new_tokens=10, seed=i)) for i, p in enumerate(PROMPTS)]}
    got, want = drain(gen, schedule)[0], drain(fresh, schedule)[0]
    for rid in want:
        assert got[rid].output_ids == want[rid].output_ids and got[rid].logprobs == want[rid].logprobs


def test_bfloat16_models_keep_torchs_linears_on_a_cpu_without_onednn_bf16(folders, monkeypatch):
    """An AVX2-only CPU (this project's CI machine) has no oneDNN bf16 kernels: packing a bf16 model there raised
    in mkldnn_reorder_linear_weight, so the generator must fall back to torch's linears; float32 still packs."""
    from areal_local import packed

    monkeypatch.setattr(packed, "onednn_bf16_supported", lambda: False)
    bf16 = load(folders["qwen2"], dtype=torch.bfloat16)
    assert not packed.packing_available(bf16)
    assert Generator(bf16, eos_token_ids=[])._packed is None
    with pytest.raises(ValueError, match="AVX512"):
        packed.PackedLinears(bf16)
    assert packed.packing_available(load(folders["qwen2"]))
    monkeypatch.setattr(packed, "onednn_bf16_supported", lambda: True)
    assert packed.packing_available(bf16)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "torch-linears"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-all-biases"])
def test_lean_decode_is_the_default_and_gives_the_plain_forwards_tokens_and_logprobs(folders, arch, packed):
    if arch == "llama-all-biases":  # every projection biased: the post-op matmuls carry biases too
        config = AutoConfig.from_pretrained(folders["llama"])
        config.attention_bias = config.mlp_bias = True
        model = redraw(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"), 5)
    else:
        model = load(folders[arch], seed=5)
    with torch.no_grad():  # nonzero biases (qwen2: q/k/v), so the fused biases are exercised
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
    schedule = {0: [(f"a{i}", p, SamplingParams(max_new_tokens=10, seed=i)) for i, p in enumerate(PROMPTS[:3])],
                3: [(f"b{i}", p, SamplingParams(max_new_tokens=6, seed=10 + i)) for i, p in enumerate(PROMPTS[3:])]}
    lean_gen = Generator(model, eos_token_ids=[], packed_linears=packed)
    assert lean_gen._lean is not None and lean_gen._lean.packed == packed
    lean, _ = drain(lean_gen, schedule)
    plain_gen = Generator(model, eos_token_ids=[], lean_decode=False, packed_linears=packed)
    assert plain_gen._lean is None
    plain, _ = drain(plain_gen, schedule)
    assert sorted(lean) == sorted(plain)
    for rid in plain:
        assert lean[rid].output_ids == plain[rid].output_ids
        assert max(abs(a - b) for a, b in zip(lean[rid].logprobs, plain[rid].logprobs)) < 1e-4


def test_lean_decode_refuses_what_it_cannot_reproduce():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from areal_local.lean_decode import supports

    windowed = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                            sliding_window=4, max_window_layers=0))
    assert not supports(windowed)
    with pytest.raises(ValueError, match="lean_decode=True but Qwen2ForCausalLM is not a Llama-family model"):
        Generator(windowed, eos_token_ids=[], lean_decode=True)


def _mapped(path) -> bool:
    return any(str(path) in line for line in open("/proc/self/maps").read().splitlines())


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
def test_own_memory_lets_the_model_files_mapping_go_and_keeps_every_value(tmp_path):
    """from_pretrained in the file's dtype leaves the weights as views of a copy-on-write mapping of the file, so
    the server's first weight update would fault every page in (areal_local.server.own_memory); after
    own_memory nothing maps the file, the values are the same and a tied head is still the embedding."""
    import gc

    from areal_local.server import own_memory

    folder = tiny_model(tmp_path / "tied", arch="llama", tie_word_embeddings=True)
    file = folder / "model.safetensors"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    assert _mapped(file), "precondition: transformers maps the file (if this changes, own_memory may be moot)"
    copied = own_memory(model)
    gc.collect()
    assert not _mapped(file)
    assert copied == sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert model.lm_head.weight is model.model.embed_tokens.weight
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_warming_weight_loads_changes_no_packed_copy(folders):
    """warm_weight_loads rebuilds the derived copies in place before any load: the same tensors, the same bits."""
    gen = Generator(load(folders["llama"], seed=5), eos_token_ids=[])
    packed = {k: (t, t.to_dense().clone()) for k, t in gen._packed._packed.items()}
    qkv = [(w, w.to_dense().clone()) for w, _ in gen._lean._qkv]
    gen.warm_weight_loads()
    assert all(gen._packed._packed[k] is t and torch.equal(t.to_dense(), bits) for k, (t, bits) in packed.items())
    assert all(w is t and torch.equal(w.to_dense(), bits) for (w, _), (t, bits) in zip(gen._lean._qkv, qkv))


def test_the_forward_uses_the_cache_argument_transformers_keeps(llama):
    """transformers 5.x renamed forward's ``past_key_values`` to ``cache``, warning (FutureWarning) that the old
    name goes in 5.40: the generator passes whichever the installed release's forward takes, with no warning."""
    import inspect
    import warnings

    gen = Generator(llama, eos_token_ids=[EOS], max_batch=2, lean_decode=False, packed_linears=False)
    takes = inspect.signature(llama.forward).parameters
    assert gen._cache_arg == ("cache" if "cache" in takes else "past_key_values")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        results, _ = drain(gen, {0: [("a", PROMPTS[0], greedy(6))]})
    assert results["a"].output_ids == hf_greedy(llama, PROMPTS[0], 6)
