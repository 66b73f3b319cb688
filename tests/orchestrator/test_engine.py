"""The decoding loop: greedy equivalence, determinism, no wasted work, streaming, stops,
metrics and request validation."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from hydra_jury.cli import main
from hydra_jury.orchestrator.backend import ModelInfo
from hydra_jury.orchestrator.engine import REBUILDS_PER_ROUND, Engine
from hydra_jury.orchestrator.local_backend import LocalBackend
from hydra_jury.orchestrator.request import GenerationRequest, RequestError
from hydra_jury.poe import RULES
from hydra_jury.serving.worker_service import service_main
from hydra_jury.trunk_service.server import TRUNK_SERVICE
from hydra_jury.workers.errors import PositionError
from hydra_jury.workers.sessions import SessionLimits

PROMPTS = ["hi", "the cat sat", "abc, xyz!"]


def greedy(prompt: str, **options) -> GenerationRequest:
    """A greedy request drafted by head3 unless the options say otherwise."""
    values = {
        "max_new_tokens": 64,
        "temperature": 0.0,
        "ignore_eos": True,
        "seed": 0,
        "drafter": "head",
        "draft_head": "head3",
        **options,
    }
    return GenerationRequest(prompt=prompt, **values)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculative_equals_non_speculative_poe(engine, prompt):
    reference = engine.generate(
        greedy(prompt, rule="verifier_only", draft_head=None, jury=["head0", "head1", "head2"])
    )
    assert len(reference.token_ids) == 64
    for gamma in (1, 3, 8):
        output = engine.generate(greedy(prompt, gamma=gamma))
        assert output.token_ids == reference.token_ids, f"gamma={gamma}"
        assert output.text == reference.text
        # Different heads really disagree here, so the test exercises rejections.
        if gamma == 8:
            assert output.stats["accepted"] < output.stats["drafted"]


def test_same_seed_same_output_and_different_seeds_differ(engine):
    request = GenerationRequest(
        prompt="hi", max_new_tokens=40, ignore_eos=True, gamma=3, drafter="head"
    )
    first = engine.generate(GenerationRequest(**{**vars(request), "seed": 7}))
    again = engine.generate(GenerationRequest(**{**vars(request), "seed": 7}))
    other = engine.generate(GenerationRequest(**{**vars(request), "seed": 8}))
    assert first.token_ids == again.token_ids and first.tokens == again.tokens
    assert first.stats == again.stats
    assert other.token_ids != first.token_ids


def test_unseeded_requests_report_their_seed_and_replay(engine):
    output = engine.generate(GenerationRequest(prompt="hi", max_new_tokens=20, ignore_eos=True))
    replay = engine.generate(
        GenerationRequest(prompt="hi", max_new_tokens=20, ignore_eos=True, seed=output.seed)
    )
    assert replay.token_ids == output.token_ids and replay.draft_head == output.draft_head


def test_draft_head_is_drawn_from_the_seed(engine):
    heads = {
        engine.prepare(
            GenerationRequest(prompt="hi", seed=seed, max_new_tokens=8, drafter="head")
        ).draft_head
        for seed in range(40)
    }
    assert heads == {"head0", "head1", "head2", "head3"}
    prepared = engine.prepare(
        GenerationRequest(prompt="hi", seed=1, max_new_tokens=8, drafter="head")
    )
    assert prepared.draft_head not in prepared.jury and len(prepared.jury) == 3


class CountingBackend(LocalBackend):
    """The in-process backend, recording every call the loop makes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple] = []

    def prefill(self, call):
        self.calls.append(("prefill", call.start, len(call.tokens)))
        super().prefill(call)

    def draft(self, call):
        # γ steps; a one-pass check's one step runs its pending token and outside drafts.
        self.calls.append(("draft", call.start, call.gamma + len(call.outside_drafts)))
        return super().draft(call)

    def score(self, call):
        self.calls.append(("score", call.start, call.hidden.rows))
        return super().score(call)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_wasted_work(jury_model, tokenizer, temperature):
    backend = CountingBackend(jury_model, limits=SessionLimits(1, 128))
    engine = Engine(backend, tokenizer)
    gamma, prompt = 4, tokenizer.encode("the cat", add_special_tokens=False)
    output = engine.generate(
        GenerationRequest(
            prompt="the cat",
            max_new_tokens=48,
            gamma=gamma,
            ignore_eos=True,
            seed=3,
            temperature=temperature,
            drafter="head",
        )
    )
    calls = backend.calls
    assert calls[0] == ("prefill", 0, len(prompt) - 1)
    rounds = calls[1:]
    assert len(rounds) == 2 * output.stats["rounds"]
    processed = len(prompt) - 1
    for (kind_d, start_d, gamma_d), (kind_s, start_s, rows), size in zip(
        rounds[::2], rounds[1::2], output.rounds, strict=True
    ):
        # One draft call of γ trunk steps and one jury call per round, both starting at
        # the processed length: nothing re-runs after a rejection.
        assert (kind_d, kind_s) == ("draft", "score")
        assert start_d == start_s == processed and rows == gamma_d
        assert gamma_d == min(gamma, 48 - (processed - len(prompt) + 1))
        processed += size  # a kept + the replacement, or all γ: the next round starts there
    counters = backend.trunk.counters
    drafted = output.stats["drafted"]
    assert counters.trunk_positions == len(prompt) - 1 + drafted
    assert output.stats["trunk_steps"] == drafted
    assert backend.jury.counters.calls == output.stats["rounds"] + 1  # + the prefill
    assert output.stats["accepted"] < drafted  # rejections happened


def test_streaming_delivers_the_unary_tokens_round_by_round(engine):
    request = GenerationRequest(
        prompt="the cat", max_new_tokens=30, ignore_eos=True, seed=5, gamma=3, drafter="head"
    )
    unary = engine.generate(request)
    messages = list(engine.stream(request))
    assert [len(m.tokens) for m in messages] == unary.rounds
    assert [t.token_id for m in messages for t in m.tokens] == unary.token_ids
    assert "".join(m.text for m in messages) == unary.text
    assert [m.index for m in messages] == list(range(len(messages)))
    assert [m.finish_reason for m in messages] == [None] * (len(messages) - 1) + ["length"]


def test_stream_releases_caches_when_abandoned(jury_model, tokenizer):
    backend = LocalBackend(jury_model, limits=SessionLimits(1, 128))
    engine = Engine(backend, tokenizer)
    stream = engine.stream(GenerationRequest(prompt="hi", max_new_tokens=30, seed=1))
    next(stream)
    assert len(backend.trunk.sessions) == 1
    stream.close()
    assert len(backend.trunk.sessions) == len(backend.jury.sessions) == 0


def test_stop_sequence_and_eos(jury_model, tokenizer, engine):
    full = engine.generate(greedy("hi", max_new_tokens=40))
    stop = full.text[10:12]
    cut = full.text.index(stop)
    stopped = engine.generate(greedy("hi", max_new_tokens=40, stop=[stop]))
    assert stopped.finish_reason == "stop" and stopped.text == full.text[:cut]
    assert full.token_ids[: len(stopped.token_ids)] == stopped.token_ids

    # Any token can be the end-of-sequence token: make it the 6th generated one.
    backend = LocalBackend(jury_model, limits=SessionLimits(1, 128))
    eos = full.token_ids[5]
    backend.info = ModelInfo(**{**vars(backend.info), "eos_token_ids": (eos,)})
    ended = Engine(backend, tokenizer).generate(greedy("hi", max_new_tokens=40, ignore_eos=False))
    first = full.token_ids.index(eos)
    assert ended.finish_reason == "eos" and ended.token_ids == full.token_ids[: first + 1]


def test_per_token_metrics_and_request_stats(engine):
    output = engine.generate(
        GenerationRequest(
            prompt="hi", max_new_tokens=40, seed=2, gamma=4, ignore_eos=True, drafter="head"
        )
    )
    replacements = [t for t in output.tokens if t.kind == "replacement"]
    assert replacements and all(t.kind in ("draft", "replacement") for t in output.tokens)
    for record in output.tokens:
        assert record.entropy >= 0 and 0 <= record.stability_margin <= 1
        assert set(record.votes) == set(output.jury)
        assert record.stability_radius >= 0
    for record in replacements:
        assert record.rejected_token is not None and record.rejected_token != record.token_id
        assert 0 <= record.suppression_score <= 1 and record.validity_radius >= 0
    stats = output.stats
    assert stats["rounds"] == len(output.rounds)
    assert stats["acceptance_rate"] == stats["accepted"] / stats["drafted"]
    assert stats["mean_accepted_length"] == pytest.approx(40 / stats["rounds"])
    positions = [t.position for t in output.tokens]
    assert positions == list(range(positions[0], positions[0] + 40))


def test_logprobs_are_the_targets_of_the_emitted_tokens(engine):
    """Speculative and sampled: each token's log-probability and the likeliest tokens'
    are read from the target its position was decided on (the entropy's)."""
    request = GenerationRequest(
        prompt="hi", max_new_tokens=12, seed=3, ignore_eos=True, drafter="head", logprobs=True
    )
    plain = engine.generate(request)
    assert all(t.logprob is not None and t.top_logprobs == [] for t in plain.tokens)
    ranked = engine.generate(replace(request, top_logprobs=4))
    assert ranked.token_ids == plain.token_ids
    for record in ranked.tokens:
        likeliest = {top["token_id"]: top["logprob"] for top in record.top_logprobs}
        values = list(likeliest.values())
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert record.logprob <= values[0] <= 0
        assert likeliest.get(record.token_id, record.logprob) == record.logprob
    assert engine.generate(replace(request, logprobs=False)).tokens[0].logprob is None


@pytest.mark.parametrize("rule", [r for r in RULES if r != "verifier_only"])
def test_every_rule_runs(engine, rule):
    """What every speculative rule must do: keep at most what it drafted, replace a rejected
    token with another (the residual max(π − q, 0) is 0 wherever q ≥ π, which is where a
    draft can be rejected), and draw the same tokens for the same seed."""
    lenience = 0.3 if rule in ("lenient",) or rule.startswith("cascade") else 0.0
    request = GenerationRequest(
        prompt="hi",
        rule=rule,
        lenience=lenience,
        drafter="head",  # a fixed round structure (the automatic mode's follows timings)
        max_new_tokens=12,
        seed=4,
        temperature=0.7,
        top_p=0.9,
        ignore_eos=True,
    )
    output = engine.generate(request)
    stats = output.stats
    assert len(output.token_ids) == 12 and sum(output.rounds) == 12
    assert 0 <= stats["accepted"] <= stats["drafted"] and stats["rounds"] == len(output.rounds)
    if rule == "drafter_only":
        assert stats["accepted"] == stats["drafted"] == 12
        assert output.jury == [] and output.tokens[0].entropy is None
        assert {t.kind for t in output.tokens} == {"draft"}
    else:
        assert output.jury and stats["drafted"] > 0
        assert {t.kind for t in output.tokens} <= {"draft", "replacement", "bonus"}
        for record in output.tokens:
            if record.kind == "replacement":
                assert record.rejected_token != record.token_id
    assert engine.generate(request).token_ids == output.token_ids


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"gamma": 0}, r"gamma \(draft length\) must be an integer in 1..16"),
        ({"gamma": 17}, r"gamma \(draft length\) must be an integer in 1..16"),
        ({"temperature": -0.5}, "temperature must be finite and >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"min_p": 1.0}, r"min_p must be in \[0, 1\)"),
        ({"epsilon": 1.5}, r"epsilon must be in \[0, 1\)"),
        ({"rule": "majority"}, "unknown rule 'majority'"),
        ({"rule": "lenient", "lenience": 1.0}, "lenience"),
        ({"rule": "cascade_chow", "lenience": -0.1}, "lenience"),
        ({"draft_head": "head9"}, "unknown draft head 'head9'"),
        ({"jury": ["head0", "head7"]}, r"unknown jury heads \['head7'\]"),
        (
            {"drafter": "head", "draft_head": "head0", "jury": ["head0", "head1"]},
            "cannot sit in its own jury",
        ),
        ({"draft_head": "head0", "jury": []}, "the jury is empty"),
        ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
        ({"max_new_tokens": 127}, "exceeds the context limit of 128"),
        ({"prompt": "a" * 129}, "the prompt has 129 tokens, over the context limit of 128"),
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": None}, "give exactly one of prompt and messages"),
        ({"seed": -1}, r"seed must be an integer in \[0, 2\*\*63\)"),
        ({"beta": 0.0}, r"beta must be in \(0, 100\]"),
        ({"stop": [""]}, "stop sequences must be non-empty strings"),
        ({"rule": "verifier_only", "draft_head": "head1"}, "does not draft"),
        ({"drafter": "oracle"}, "unknown drafter 'oracle'; choose one of auto, head, ngram, model"),
        ({"drafter": "model"}, "drafter 'model': the trunk hosts no draft model"),
        ({"drafter": "ngram", "rule": "verifier_only"}, "conflicts with rule 'verifier_only'"),
        ({"drafter": "ngram", "rule": "drafter_only"}, "conflicts with rule 'drafter_only'"),
        ({"drafter": "ngram", "draft_head": "head1"}, "drafts without a head"),
        ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, r"top_logprobs must be an integer in 0..20"),
        ({"logprobs": True, "rule": "drafter_only"}, "rule drafter_only computes no target"),
        ({"logprobs": True, "num_beams": 2}, "beam search scores whole hypotheses"),
    ],
)
def test_invalid_options_fail_before_any_compute(jury_model, tokenizer, options, message):
    backend = CountingBackend(jury_model, limits=SessionLimits(1, 128))
    request = GenerationRequest(**{"prompt": "hi", "max_new_tokens": 8, **options})
    with pytest.raises(RequestError, match=message):
        Engine(backend, tokenizer).stream(request)
    assert backend.calls == []


def test_chat_messages_use_the_chat_template(engine, tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    prepared = engine.prepare(GenerationRequest(messages=messages, max_new_tokens=8))
    expected = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert prepared.prompt_tokens == list(expected)
    with pytest.raises(RequestError, match="each message needs a role and a content"):
        engine.prepare(GenerationRequest(messages=[{"text": "hi"}]))


def test_cli_generate(jury_checkpoint, capsys):
    argv = [
        "generate",
        "--checkpoint",
        str(jury_checkpoint),
        "--local",
        "hi",
        "--no-chat",
        "--max-new-tokens",
        "10",
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        "1",
    ]
    assert main([*argv, "--json"]) == 0
    output = json.loads(capsys.readouterr().out)
    assert len(output["token_ids"]) == 10 and output["stats"]["rounds"] >= 1
    assert main(argv) == 0
    assert capsys.readouterr().out == output["text"] + "\n"
    assert main([*argv, "--gamma", "40"]) == 2
    assert "gamma (draft length) must be an integer in 1..16" in capsys.readouterr().err


def test_cli_generate_with_a_draft_model(jury_checkpoint, capsys, tmp_path, monkeypatch):
    """`--draft-model` takes a Hugging Face directory (converted once into the cache) or
    a Hydra checkpoint; greedy drafts from it give the non-speculative tokens."""
    monkeypatch.setenv("HYDRA_JURY_CACHE", str(tmp_path / "cache"))
    argv = [
        *("generate", "--checkpoint", str(jury_checkpoint), "--local", "abcab", "--no-chat"),
        *("--max-new-tokens", "12", "--ignore-eos", "--temperature", "0", "--json"),
    ]
    assert main([*argv, "--rule", "verifier_only"]) == 0
    reference = json.loads(capsys.readouterr().out)
    hf_directory = str(jury_checkpoint.parent / "base")
    assert main([*argv, "--draft-model", hf_directory, "--drafter", "model"]) == 0
    captured = capsys.readouterr()
    output = json.loads(captured.out)
    assert output["token_ids"] == reference["token_ids"]
    assert output["stats"]["rounds_by_drafter"]["model"] > 0
    assert "converting into" in captured.err
    (converted,) = (tmp_path / "cache" / "draft-models").iterdir()
    assert main([*argv, "--draft-model", str(converted), "--drafter", "model"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == reference["token_ids"]
    assert main([*argv, "--draft-model", str(tmp_path / "missing"), "--drafter", "model"]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert main([*argv, "--drafter", "model"]) == 2
    assert "the trunk hosts no draft model" in capsys.readouterr().err


def test_lost_caches_are_rebuilt_from_the_committed_tokens(jury_model, tokenizer):
    """A service that loses a session mid-generation (a restart) costs a re-prefill, not
    the request: the output is the same as without the loss."""
    request = GenerationRequest(
        prompt="the cat", max_new_tokens=30, ignore_eos=True, seed=9, gamma=3
    )
    backend = CountingBackend(jury_model, limits=SessionLimits(1, 128))
    engine = Engine(backend, tokenizer)
    expected = engine.generate(request)
    backend.calls.clear()
    tokens = []
    generation = engine.start(request)
    for index, message in enumerate(generation):
        tokens += [t.token_id for t in message.tokens]
        if index == 2:
            assert backend.jury.release(generation.session)
    assert tokens == expected.token_ids
    assert [c for c in backend.calls if c[0] == "prefill"][1][1] == 0  # rebuilt from 0


class ForgetfulBackend(CountingBackend):
    """Its jury drops the session before each of the next `losses` score calls, as a
    full service giving an idle session's slot away again and again."""

    losses = 0

    def score(self, call):
        if self.losses:
            self.losses -= 1
            self.jury.release(call.session)
        return super().score(call)


@pytest.mark.parametrize("losses", [1, 3, 4])
def test_a_round_rebuilds_lost_caches_a_bounded_number_of_times(jury_model, tokenizer, losses):
    request = GenerationRequest(prompt="the cat", max_new_tokens=12, ignore_eos=True, seed=9)
    backend = ForgetfulBackend(jury_model, limits=SessionLimits(1, 128))
    engine = Engine(backend, tokenizer)
    expected = engine.generate(request)
    generation = engine.start(request)
    first = next(iter(generation))  # the first round, with its caches
    backend.losses = losses
    if losses > REBUILDS_PER_ROUND:
        with pytest.raises(PositionError, match="re-prefill"):
            list(generation)
        return
    tokens = [t.token_id for t in first.tokens]
    tokens += [t.token_id for output in generation for t in output.tokens]
    assert tokens == expected.token_ids


def test_statistics_stop_at_an_end_of_sequence_cut(jury_model, tokenizer):
    """A round cut by a stop condition counts only the draft tokens up to the cut: the
    tokens after it were never emitted."""
    request = greedy("hi", max_new_tokens=40, rule="drafter_only", gamma=4)
    full = Engine(LocalBackend(jury_model, limits=SessionLimits(1, 128)), tokenizer).generate(
        request
    )
    # An end-of-sequence token in the middle of a round (not its last token).
    index = next(
        i for i, t in enumerate(full.token_ids) if i % 4 != 3 and full.token_ids.index(t) == i
    )
    backend = LocalBackend(jury_model, limits=SessionLimits(1, 128))
    backend.info = ModelInfo(**{**vars(backend.info), "eos_token_ids": (full.token_ids[index],)})
    ended = Engine(backend, tokenizer).generate(
        GenerationRequest(**{**vars(request), "ignore_eos": False})
    )
    assert ended.finish_reason == "eos" and len(ended.token_ids) == index + 1
    stats = ended.stats
    assert stats["emitted"] == stats["drafted"] == stats["accepted"] == index + 1
    assert sum(ended.rounds) == index + 1
    assert stats["mean_accepted_length"] == (index + 1) / stats["rounds"]


def test_statistics_stop_at_a_stop_sequence_cut(engine):
    stopped = 0
    for seed in range(6):
        output = engine.generate(
            GenerationRequest(
                prompt="hi", max_new_tokens=60, seed=seed, gamma=6, ignore_eos=True, stop=["a"]
            )
        )
        stats = output.stats
        assert stats["emitted"] == len(output.token_ids) == sum(output.rounds)
        assert stats["mean_accepted_length"] == len(output.token_ids) / stats["rounds"]
        stopped += output.finish_reason == "stop"
    assert stopped >= 3


class TiedTargetBackend(LocalBackend):
    """The in-process backend with the jury's log-product replaced by one whose top two
    tokens tie exactly: the greedy tie rule decides the token."""

    TIED = (7, 3)

    def score(self, call):
        result = super().score(call)
        log_product = torch.full_like(result.log_product, -20.0)
        log_product[:, list(self.TIED)] = 0.0
        return replace(result, log_product=log_product)


def test_greedy_paths_break_ties_the_same_way(jury_model, tokenizer):
    """Speculative and non-speculative greedy both take `poe.greedy_tokens` of the same
    float32 target, so a tie goes to the lowest token id on both paths."""
    engine = Engine(TiedTargetBackend(jury_model, limits=SessionLimits(1, 128)), tokenizer)
    non_speculative = engine.generate(
        greedy("hi", max_new_tokens=6, rule="verifier_only", draft_head=None)
    )
    speculative = engine.generate(greedy("hi", max_new_tokens=6, gamma=3))
    assert non_speculative.token_ids == speculative.token_ids == [3] * 6


class CountingTokenizer:
    """The tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **options):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **options)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("stop", [[], ["zzz", "q!"]])
def test_text_is_decoded_incrementally(jury_model, tokenizer, stop):
    """Decoding work grows linearly with the output, with or without stop sequences
    (re-decoding the whole text every round is quadratic: about 2,700 ids here)."""
    counting = CountingTokenizer(tokenizer)
    engine = Engine(LocalBackend(jury_model, limits=SessionLimits(1, 128)), counting)
    prompt_cost = counting.decoded
    output = engine.generate(greedy("hi", max_new_tokens=120, gamma=2, stop=stop))
    assert len(output.token_ids) == 120
    assert counting.decoded - prompt_cost <= 16 * 120
    assert output.text == tokenizer.decode(output.token_ids, skip_special_tokens=True)


def test_stream_never_sends_text_a_stop_sequence_later_cuts(engine, tokenizer):
    """A stop sequence that spans two rounds: its first part is held back, not sent and
    then cut."""
    request = greedy("hi", max_new_tokens=60, gamma=3)
    full = engine.generate(request)
    boundaries = [sum(full.rounds[: k + 1]) for k in range(len(full.rounds) - 1)]
    for boundary in boundaries:
        at = len(tokenizer.decode(full.token_ids[:boundary], skip_special_tokens=True))
        stop = full.text[at - 2 : at + 1]
        if len(stop) == 3 and full.text.find(stop) == at - 2:
            break
    else:
        pytest.skip("no stop sequence spans a round boundary in this output")
    messages = list(engine.stream(GenerationRequest(**{**vars(request), "stop": [stop]})))
    sent = "".join(message.text for message in messages)
    assert messages[-1].finish_reason == "stop"
    assert sent == full.text[: at - 2]


REPEATING = ["abcabcabc", "the cat sat. the cat sat. the", "hi hi hi"]


@pytest.mark.parametrize("prompt", REPEATING)
def test_greedy_ngram_speculation_equals_non_speculative_poe(engine, prompt):
    """Drafts from prompt lookup, checked in one pass: greedy output equals greedy
    non-speculative PoE over the same jury (every head), token for token."""
    reference = engine.generate(greedy(prompt, rule="verifier_only", draft_head=None))
    for gamma in (1, 4, 8):
        output = engine.generate(greedy(prompt, gamma=gamma, drafter="ngram", draft_head=None))
        assert output.token_ids == reference.token_ids, f"gamma={gamma}"
        assert output.jury == ["head0", "head1", "head2", "head3"]  # no head drafts
        kinds = {record.kind for record in output.tokens}
        assert "bonus" in kinds and "draft" in kinds, kinds


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_one_pass_rounds_do_no_wasted_work(jury_model, tokenizer, temperature):
    """Each round: one trunk step over the pending token and the k draft tokens (a draft
    call of outside drafts), one jury call over the same k + 1 positions, both at the
    processed length; a round that keeps every draft commits k + 1 tokens (the bonus)."""
    backend = CountingBackend(jury_model, limits=SessionLimits(1, 128))
    prompt = "abcabcabcabc"
    prompt_tokens = tokenizer.encode(prompt, add_special_tokens=False)
    output = Engine(backend, tokenizer).generate(
        GenerationRequest(
            prompt=prompt,
            drafter="ngram",
            gamma=4,
            max_new_tokens=40,
            ignore_eos=True,
            seed=5,
            temperature=temperature,
        )
    )
    assert len(output.token_ids) == 40  # the bonus never overshoots the limit
    calls = backend.calls
    assert calls[0] == ("prefill", 0, len(prompt_tokens) - 1)
    processed = len(prompt_tokens) - 1
    stats = output.stats
    bonuses = sum(record.kind == "bonus" for record in output.tokens)
    for (kind_t, start_t, rows_t), (kind_s, start_s, rows_s), size in zip(
        calls[1::2], calls[2::2], output.rounds, strict=True
    ):
        assert (kind_t, kind_s) == ("draft", "score")
        assert start_t == start_s == processed and rows_t == rows_s
        assert size <= rows_t  # at most k + 1 tokens from k + 1 positions
        processed += size
    assert stats["emitted"] == 40 and stats["rounds"] == len(output.rounds)
    assert stats["trunk_steps"] == sum(rows for kind, _, rows in calls if kind == "draft")
    # Every round commits its kept drafts and one more: a replacement, a sample or a bonus.
    assert bonuses > 0 and stats["emitted"] == stats["accepted"] + stats["rounds"]


@pytest.mark.parametrize("prompt", REPEATING)
def test_sampled_ngram_speculation_gives_the_non_speculative_tokens(engine, prompt):
    """Point-mass drafts are checked against the very draw a plain step makes at each
    position (a coupling that is exact), so with the same seed the tokens equal those
    of non-speculative PoE — drafts change the speed, never the output."""
    options = {"temperature": 0.9, "top_k": 20, "seed": 17, "max_new_tokens": 48}
    reference = engine.generate(greedy(prompt, rule="verifier_only", draft_head=None, **options))
    for gamma in (2, 8):
        output = engine.generate(
            greedy(prompt, gamma=gamma, drafter="ngram", draft_head=None, **options)
        )
        assert output.token_ids == reference.token_ids, f"gamma={gamma}"
        assert output.stats["accepted"] > 0 and output.stats["rounds"] < 48


@pytest.mark.parametrize("prompt", ["hello there", *REPEATING])
def test_greedy_model_speculation_equals_non_speculative_poe(model_engine, prompt):
    """Drafts from the draft model, checked in one pass: greedy output equals greedy
    non-speculative PoE over the same jury (every head), token for token."""
    reference = model_engine.generate(greedy(prompt, rule="verifier_only", draft_head=None))
    for gamma in (1, 4, 8):
        output = model_engine.generate(
            greedy(prompt, gamma=gamma, drafter="model", draft_head=None)
        )
        assert output.token_ids == reference.token_ids, f"gamma={gamma}"
        assert output.jury == ["head0", "head1", "head2", "head3"]  # no head drafts
        # A plain step only where the token limit leaves no room for a draft.
        assert output.stats["rounds_by_drafter"].get("none", 0) <= 1
        kinds = {record.kind for record in output.tokens}
        assert "draft" in kinds, kinds
    assert "bonus" in kinds, kinds  # γ = 8 sometimes keeps every draft


def test_sampled_model_speculation_is_seeded_and_keeps_drafts(model_engine):
    options = {"temperature": 0.9, "top_p": 0.95, "seed": 23, "max_new_tokens": 40}
    request = greedy("hello there", gamma=4, drafter="model", draft_head=None, **options)
    first, again = model_engine.generate(request), model_engine.generate(request)
    assert first.token_ids == again.token_ids  # same seed, same tokens
    other = model_engine.generate(GenerationRequest(**{**vars(request), "seed": 24}))
    assert other.token_ids != first.token_ids
    assert first.stats["accepted"] > 0 and first.stats["rounds"] < 40


def test_the_draft_model_is_described_in_the_model_info(model_engine, engine):
    assert "4 layers" in model_engine.backend.info.draft_model
    assert engine.backend.info.draft_model == ""


def test_a_trunk_service_gets_its_draft_model_resolved(
    jury_checkpoint, tmp_path, monkeypatch, capsys
):
    """`hydra-jury trunk --draft-model` converts a Hugging Face directory before the
    service (which loads only Hydra checkpoints) starts — the value argparse parsed, so an
    abbreviated flag too; a missing path is one line."""
    from hydra_jury.cli.draft import resolved_draft_model

    monkeypatch.setenv("HYDRA_JURY_CACHE", str(tmp_path))
    source = str(jury_checkpoint.parent / "base")
    converted = resolved_draft_model(source)
    assert converted.startswith(str(tmp_path / "draft-models"))
    assert resolved_draft_model(None) is None

    def refuse(path):
        raise ValueError(f"asked to resolve {path}")

    argv = ["--checkpoint", str(jury_checkpoint), "--listen", "127.0.0.1:0", "--draft-m", source]
    assert service_main(TRUNK_SERVICE, argv, resolve_draft_model=refuse) == 2
    assert f"asked to resolve {source}" in capsys.readouterr().err
    argv = ["trunk", "--checkpoint", str(jury_checkpoint), "--draft-model", str(tmp_path / "no")]
    assert main(argv) == 2
