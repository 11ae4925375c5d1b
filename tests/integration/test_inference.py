"""The inference engine: cached decoding against full recomputation, transformers, TP=2, sampling,
scoring against the model's own forward with the prefix mask, rows joining a running batch."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import torch
from conftest import tiny_config
from distributed import run_ranks
from inference_workloads import VOCAB, random_prompts, tp_workload

from mimir_megatron.batch import Batch, single_sample_batch
from mimir_megatron.inference import GenerationRequest, InferenceEngine, KVCache, RequestError, SamplingParams
from mimir_megatron.model import build_model

@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config("seed=5")).eval()


@pytest.fixture(scope="module")
def engine(model):
    return InferenceEngine(model, None, max_batch_size=64)


@torch.no_grad()
def uncached_last_logits(model, rows: list[list[int]], prompt_lengths: list[int], h: int, low: int) -> torch.Tensor:
    """Logits after each row from one full forward (no cache): the prompt is the prefix, the rest
    is causal, right padding, as the training batch lays it out."""
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    seg, pos = torch.zeros_like(ids), torch.zeros_like(ids)
    prefix = torch.zeros_like(ids, dtype=torch.bool)
    for r, (row, n_prompt) in enumerate(zip(rows, prompt_lengths)):
        ids[r, : len(row)] = torch.tensor(row)
        seg[r, : len(row)] = 1
        pos[r, : len(row)] = torch.arange(len(row))
        prefix[r, :n_prompt] = True
    logits = model(Batch(ids, pos, seg, prefix), h_cycles=h, l_cycles=low, validate=False).logits
    return logits[torch.arange(len(rows)), torch.tensor([len(r) - 1 for r in rows])]


@pytest.mark.parametrize("h,low", [(1, 3), (2, 1), (3, 3)])
def test_cached_greedy_equals_full_recomputation(model, engine, h, low):
    prompts = random_prompts(range(1, 41))
    plan = engine.plan(h, low)
    cache = engine.new_cache()
    logits = engine.forward(cache, [], prompts, plan)
    generated = [[] for _ in prompts]
    for step in range(6):
        reference = uncached_last_logits(model, [p + g for p, g in zip(prompts, generated)],
                                         [len(p) for p in prompts], h, low)
        assert (logits - reference).abs().max().item() < 1e-5, f"step {step}"
        tokens = logits.argmax(-1).tolist()
        for g, t in zip(generated, tokens):
            g.append(t)
        logits = engine.forward(cache, tokens, [], plan)
    # generate() (sessions, stop handling, sorting by length) gives the same tokens
    results = engine.generate([GenerationRequest(p, SamplingParams(max_new_tokens=6), h, low) for p in prompts])
    assert [r.token_ids for r in results] == generated
    assert all(r.finish_reason == "length" and len(r.logprobs) == 6 for r in results)


def test_flat_steps_decode_like_megatrons_layers(model, engine):
    """The engine's flattened steps (inference/step.py: decoding rows and joining prompts in one
    pass, one KV-cache row per request) against the same engine on megatron's modules (one pass
    per kind, right-padded): every step's logits within 1e-5, the same greedy tokens, with
    prompts of unequal lengths joining rows that decode at unequal lengths, and rows leaving."""
    reference = InferenceEngine(model, None, max_batch_size=64, megatron_layers=True)
    assert engine._step is not None and reference._step is None and reference._stacks is None
    prompts = random_prompts([4, 11, 26, 11, 11, 1, 7], seed=8)
    joins = {0: prompts[:3], 2: prompts[3:6], 3: prompts[6:]}
    leaves = {4: [1], 5: [0, 3]}  # the last rows move into the holes
    decode_in_lockstep(engine, reference, engine.plan(2, 2), steps=7, joins=joins, leaves=leaves)


def decode_in_lockstep(engine, other, plan, steps: int, joins: dict, leaves: dict | None = None,
                       around_step=lambda step: nullcontext()) -> None:
    """Greedy decoding with ``engine`` and ``other`` fed the same tokens, ``joins[step]`` prompts
    joining and ``leaves[step]`` rows leaving at a step (``other``'s steps inside
    ``around_step(step)``): the logits of every step within 1e-5, the same argmax."""
    caches = engine.new_cache(), other.new_cache()
    tokens: list[int] = []
    for step in range(steps):
        prompts = joins.get(step, [])
        logits = engine.forward(caches[0], tokens, prompts, plan)
        with around_step(step):
            other_logits = other.forward(caches[1], tokens, prompts, plan)
        assert (logits - other_logits).abs().max().item() < 1e-5, f"step {step}"
        tokens = logits.argmax(-1).tolist()
        assert tokens == other_logits.argmax(-1).tolist()
        gone = (leaves or {}).get(step, [])
        if gone:
            order = caches[0].remove(gone)
            assert caches[1].remove(gone) == order
            tokens = [tokens[i] for i in order]


@pytest.mark.slow  # a torch.compile
def test_compiled_decode_equals_eager_decode():
    """compile_decode on CPU: decoding-only steps through torch.compile with dynamic shapes give
    eager decoding's tokens and logits (1e-5, fp32) with ONE compile per schedule, while rows
    decode at unequal lengths, leave (3 rows, then 2, then 1, padded to 2), and the cache grows
    past its first allocation (a recompile would fail the test); steps with a joining prompt run
    eagerly. One layer per module and the schedule L H: the compile's cost grows with the layer
    applications it unrolls, and what is compiled is the same per layer."""
    model = build_model(tiny_config("seed=5", "num_layers_L=1", "num_layers_H=1")).eval()
    engine = InferenceEngine(model, None, max_batch_size=64)
    compiled = InferenceEngine(model, None, max_batch_size=64, compile_decode=True)
    assert not compiled.static_decode_shapes  # CPU: no CUDA graphs, no cache allocated up front
    plan = engine.plan(1, 1)
    calls = []
    graph = compiled._step._compiled
    compiled._step._compiled = lambda *a, **k: calls.append(1) or graph(*a, **k)
    prompts = random_prompts([3, 9, 14], seed=12)
    decode_in_lockstep(engine, compiled, plan, steps=9, joins={0: prompts}, leaves={3: [1], 5: [0]},
                       around_step=lambda step: torch._dynamo.config.patch(error_on_recompile=step > 1))
    assert len(calls) == 8  # every decoding-only step took the compiled path
    requests = [GenerationRequest(p, SamplingParams(max_new_tokens=5), 1, 1) for p in prompts]
    assert [r.token_ids for r in compiled.generate(requests)] == [r.token_ids for r in engine.generate(requests)]


def test_rows_joining_a_running_batch_decode_as_if_alone(engine):
    """Step-level batching: a request added mid-decode (its cache merged, left-padded) and rows
    leaving the batch change nobody's tokens."""
    prompts = random_prompts([3, 17, 9, 30, 1], seed=3)
    params = [SamplingParams(max_new_tokens=n) for n in (7, 3, 9, 5, 4)]
    alone = [engine.generate([GenerationRequest(p, q)])[0].token_ids for p, q in zip(prompts, params)]
    session = engine.open_session()
    handles = {session.add(GenerationRequest(prompts[0], params[0])): 0,
               session.add(GenerationRequest(prompts[1], params[1])): 1}
    out, step = {}, 0
    while session.active:
        if step == 2:
            handles[session.add(GenerationRequest(prompts[2], params[2]))] = 2
            handles[session.add(GenerationRequest(prompts[3], params[3]))] = 3
        if step == 4:
            handles[session.add(GenerationRequest(prompts[4], params[4]))] = 4
        rows_before = session.active
        for event in session.step():
            if event.finished:
                out[handles[event.handle]] = event.result.token_ids
        assert session.active <= rows_before
        step += 1
    assert [out[i] for i in range(5)] == alone


def test_kv_cache_rows_grow_leave_and_mask_by_length():
    """One row per request at its own length: growth keeps what was written, a row that leaves
    gets the last row copied into its place (nothing else moves), the decoding mask lets each row
    attend to its own tokens and its new one."""
    cache = KVCache("cpu")
    cache.reserve(3, 4)
    keys, values = cache.buffers((0, 1), torch.zeros(1, 1, 2))
    assert keys.shape == (3, 1, 16, 2)  # positions: at least 16
    for row, n in enumerate((2, 4, 3)):
        keys[row, 0, :n] = torch.arange(n, dtype=torch.float32)[:, None] + 10 * row
    cache.add_rows([2, 4, 3])
    cache.reserve(7, 40)  # both dimensions grow; the written tokens stay
    keys, _ = cache.buffers((0, 1), torch.zeros(1, 1, 2))
    assert keys.shape == (7, 1, 40, 2) and keys[1, 0, :4, 0].tolist() == [10.0, 11.0, 12.0, 13.0]
    rows = cache.decode_rows(3)
    assert rows.write_at is None and rows.key_length == 5 and rows.positions.tolist() == [2, 4, 3]
    assert (rows.mask[:, 0, 0] == 0).tolist() == [[True] * 3 + [False] * 2, [True] * 5, [True] * 4 + [False]]
    assert cache.remove([0]) == [2, 1]  # row 2 moved into row 0
    assert cache.lengths == [3, 4] and keys[0, 0, :3, 0].tolist() == [20.0, 21.0, 22.0]
    assert cache.remove([1]) == [0] and cache.lengths == [3]  # the last row: nothing moves
    assert cache.decode_rows(1).write_at == 3 and cache.decode_rows(1).mask is None


def test_a_cleared_kv_cache_keeps_its_buffers_and_zeroes_what_was_written():
    """A session's cache, handed back, serves the next session as a new one would: no row, the
    same buffers at their room (nothing allocated), zeros wherever any row wrote."""
    cache = KVCache("cpu")
    cache.reserve(2, 5)
    like = torch.zeros(1, 1, 2)
    cache.buffers((0, 1), like)[0][:2, :, :5] = 1.0
    cache.add_rows([5, 3])
    cache.reserve(3, 20)  # grows, keeping what was written; then a third row writes 20 positions
    keys, values = cache.buffers((0, 1), like)
    keys[2, :, :20], values[:3, :, :20] = 2.0, 3.0
    room = cache.position_room
    cache.clear()
    assert cache.rows == 0 and cache.position_room == room >= 20
    again = cache.buffers((0, 1), like)
    assert again[0] is keys and again[1] is values and not keys.any() and not values.any()


@pytest.mark.parametrize("ops", ["native", "torch"])
def test_a_session_after_another_reuses_its_cache_and_computes_as_on_a_new_one(model, ops, monkeypatch):
    """The next session takes the cache the last one handed back: no cache is made for it, and its
    logits equal, bit for bit, those of the same requests on an engine's first, new cache (rows of
    different lengths: torch's operations attend under a mask over positions the first session
    wrote; the C kernels attend each row's own)."""
    from mimir_megatron.inference import engine as engine_module
    from mimir_megatron.inference.step_ops import TorchOps

    def logged(engine):
        if ops == "torch":
            engine.step_forward.ops = TorchOps()
        steps, forward = [], engine.forward
        engine.forward = lambda *a: steps.append(forward(*a)) or steps[-1]
        return steps

    first = [GenerationRequest(p, SamplingParams(max_new_tokens=n))
             for p, n in zip(random_prompts([30, 7, 19, 12], seed=31), (9, 4, 7, 5))]
    second = [GenerationRequest(p, SamplingParams(max_new_tokens=n))
              for p, n in zip(random_prompts([4, 11, 6], seed=32), (6, 3, 8))]
    reusing, new = InferenceEngine(model, None, max_batch_size=64), InferenceEngine(model, None, max_batch_size=64)
    reused_steps, new_steps = logged(reusing), logged(new)
    reusing.generate(first)
    reused_steps.clear()
    made = []
    monkeypatch.setattr(engine_module, "KVCache", lambda *a, **k: made.append(1) or KVCache(*a, **k))
    reused = reusing.generate(second)
    assert not made
    fresh = new.generate(second)
    assert made and [r.token_ids for r in reused] == [r.token_ids for r in fresh]
    assert len(reused_steps) == len(new_steps)
    assert all(torch.equal(a, b) for a, b in zip(reused_steps, new_steps))


def test_matches_transformers_generate(model, tmp_path):
    transformers = pytest.importorskip("transformers")
    from mimir_megatron.interop import export_hf

    export_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    engine = InferenceEngine(model, None)
    prompts = random_prompts([1, 5, 12, 23], seed=9)
    ours = engine.generate([GenerationRequest(p, SamplingParams(max_new_tokens=10)) for p in prompts])
    for prompt, result in zip(prompts, ours):
        ids = torch.tensor([prompt])
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.ones_like(ids),
                          max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == result.token_ids


def test_sampling_is_reproducible_per_seed_and_respects_top_k(engine):
    prompt = random_prompts([6], seed=4)[0]

    def sample(seed, **kw):
        p = SamplingParams(max_new_tokens=12, temperature=1.0, seed=seed, **kw)
        return engine.generate([GenerationRequest(prompt, p)])[0].token_ids

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    # the same seeded request inside a batch of others gives the same tokens
    others = [GenerationRequest(q, SamplingParams(max_new_tokens=12, temperature=1.0))
              for q in random_prompts([3, 9], seed=8)]
    mixed = engine.generate([others[0], GenerationRequest(prompt, SamplingParams(
        max_new_tokens=12, temperature=1.0, seed=1)), others[1]])
    assert mixed[1].token_ids == sample(1)
    # top_k=1 is greedy
    greedy = engine.generate([GenerationRequest(prompt, SamplingParams(max_new_tokens=12))])[0].token_ids
    assert sample(3, top_k=1) == greedy
    assert sample(3, top_p=1e-6) == greedy


def test_stop_tokens_end_generation(engine):
    prompt = random_prompts([5], seed=2)[0]
    free = engine.generate([GenerationRequest(prompt, SamplingParams(max_new_tokens=8))])[0]
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    res = engine.generate([GenerationRequest(prompt, SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)))])[0]
    assert res.token_ids == free.token_ids[: first + 1] and res.finish_reason == "stop"


def test_generation_ends_at_the_last_position_of_the_context(model):
    """Prompt + generated <= max_context: a prompt one short of the context gets one token, one
    three short gets three (finish ``length`` though max_new_tokens asks for more); a prompt that
    fills the context is refused."""
    small = InferenceEngine(model, None, max_context=12)
    requests = [GenerationRequest(p, SamplingParams(max_new_tokens=10)) for p in random_prompts([11, 9], seed=3)]
    results = small.generate(requests)
    assert [(len(r.token_ids), r.finish_reason) for r in results] == [(1, "length"), (3, "length")]
    with pytest.raises(RequestError, match="prompt has 12 tokens; the context holds 12"):
        small.generate([GenerationRequest(random_prompts([12], seed=3)[0])])


@torch.no_grad()
def test_score_equals_the_model_forward_with_the_prefix_mask(model, engine):
    contexts = random_prompts([1, 4, 11], seed=12)
    continuations = random_prompts([3, 1, 6], seed=13)
    scores = engine.score(list(zip(contexts, continuations)), h_cycles=2, l_cycles=2)
    batch = single_sample_batch(contexts, continuations)
    logprobs = torch.log_softmax(model(batch, h_cycles=2, l_cycles=2, validate=False).logits, dim=-1)
    for row, (ctx, cont, score) in enumerate(zip(contexts, continuations, scores)):
        ref = [logprobs[row, len(ctx) - 1 + j, t].item() for j, t in enumerate(cont)]
        assert score.token_logprobs == pytest.approx(ref, abs=1e-5)
        assert score.logprob == pytest.approx(sum(ref), abs=1e-4)
    # the greedy continuation is recognised as such, a perturbed one is not
    greedy = engine.generate([GenerationRequest(contexts[1], SamplingParams(max_new_tokens=4), 2, 2)])[0].token_ids
    wrong = greedy[:-1] + [(greedy[-1] + 1) % VOCAB]
    got = engine.score([(contexts[1], greedy), (contexts[1], wrong)], h_cycles=2, l_cycles=2)
    assert [s.is_greedy for s in got] == [True, False]
    # scoring the whole string causally (what generic harness backends do) gives another answer
    causal = single_sample_batch([contexts[2][:1]], [contexts[2][1:] + continuations[2]])
    lp = torch.log_softmax(model(causal, h_cycles=2, l_cycles=2, validate=False).logits, dim=-1)
    causal_sum = sum(lp[0, len(contexts[2]) - 1 + j, t].item() for j, t in enumerate(continuations[2]))
    assert abs(causal_sum - scores[2].logprob) > 1e-3


@torch.no_grad()
def test_partial_prefix_score_equals_transformers_with_token_type_ids(model, engine, tmp_path):
    """Only the first ``bidirectional_tokens`` context tokens are bidirectional; transformers'
    hrm_text marks exactly those with token_type_ids = 1 (an independent implementation)."""
    transformers = pytest.importorskip("transformers")
    from mimir_megatron.interop import export_hf

    export_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    contexts = random_prompts([9, 9, 9, 9, 1, 6], seed=31)
    contexts[1:4] = [contexts[0]] * 3  # one window under four masks
    continuations = random_prompts([5, 5, 5, 5, 7, 2], seed=32)
    continuations[1:4] = [continuations[0]] * 3
    bidirectional = [0, 4, 9, None, 0, 3]
    scores = engine.score(list(zip(contexts, continuations)), bidirectional_tokens=bidirectional)
    for ctx, cont, b, score in zip(contexts, continuations, bidirectional, scores):
        ids = torch.tensor([ctx + cont[:-1]])
        types = torch.zeros_like(ids)
        types[0, : len(ctx) if b is None else b] = 1
        logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=types).logits
        lp = torch.log_softmax(logits[0].float(), dim=-1)
        ref = [lp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont)]
        assert score.token_logprobs == pytest.approx(ref, abs=1e-5)
    # the mask matters: the same window scores differently with 0, 4 and 9 bidirectional tokens
    sums = [s.logprob for s in scores[:3]]
    assert min(abs(sums[0] - sums[1]), abs(sums[1] - sums[2]), abs(sums[0] - sums[2])) > 1e-4
    assert scores[2].token_logprobs == pytest.approx(scores[3].token_logprobs, abs=1e-6)  # None = all


def test_bad_requests_name_the_field(engine):
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.generate([GenerationRequest([1, VOCAB])])
    with pytest.raises(RequestError, match="max_new_tokens"):
        engine.generate([GenerationRequest([1], SamplingParams(max_new_tokens=0))])
    with pytest.raises(RequestError, match="top_p"):
        engine.generate([GenerationRequest([1], SamplingParams(top_p=0.0))])
    with pytest.raises(RequestError, match="context holds"):
        engine.generate([GenerationRequest([1] * engine.max_context)])
    with pytest.raises(RequestError, match="h_cycles"):
        engine.generate([GenerationRequest([1], h_cycles=0)])
    with pytest.raises(RequestError, match="context must hold at least one token"):
        engine.score([([], [1])])
    with pytest.raises(RequestError, match="non-empty"):
        engine.score([([1], [])])
    with pytest.raises(RequestError, match=r"bidirectional_tokens must be an integer in \[0, 2\]"):
        engine.score([([1, 2], [3])], bidirectional_tokens=[3])
    with pytest.raises(RequestError, match="2 entries for 1 pairs"):
        engine.score([([1, 2], [3])], bidirectional_tokens=[0, 1])


@pytest.mark.multiprocess
def test_tensor_parallel_generation_equals_one_rank(engine, tmp_path):
    run_ranks("tp_generate.py", 2, str(tmp_path))
    one_rank = tp_workload(engine)
    for variant in ("sp1", "sp0"):
        tp = json.loads((tmp_path / f"tp_generate_{variant}.json").read_text())
        assert tp["greedy"] == one_rank["greedy"], variant
        assert tp["sampled"] == one_rank["sampled"], variant
        for key in ("greedy_logprobs", "scores"):
            for a, b in zip(tp[key], one_rank[key]):
                assert a == pytest.approx(b, abs=1e-4), (variant, key)


def test_exact_match_counts_only_identical_completions(model):
    """The trainer's evaluation on a fixture: references are the greedy continuations computed
    by full recomputation (no engine), then one token of every other reference is changed."""
    from mimir_megatron.data.eval import EvalSample
    from mimir_megatron.train.evaluate import exact_match

    prompts = random_prompts([4, 9, 2, 13], seed=31)
    completions = [[] for _ in prompts]
    for _ in range(5):
        logits = uncached_last_logits(model, [p + c for p, c in zip(prompts, completions)],
                                      [len(p) for p in prompts], model.cfg.h_cycles, model.cfg.l_cycles)
        for c, t in zip(completions, logits.argmax(-1).tolist()):
            c.append(t)
    samples = [EvalSample(p, c) for p, c in zip(prompts, completions)]
    unused = (min(set(range(VOCAB)) - {t for c in completions for t in c}),)  # no early stop
    assert exact_match(model, samples, max_new_tokens=5, stop_token_ids=unused) == (1.0, 4)
    broken = [EvalSample(s.prompt_ids, s.completion_ids[:2] + [(s.completion_ids[2] + 1) % VOCAB]
                         + s.completion_ids[3:]) if i % 2 else s for i, s in enumerate(samples)]
    assert exact_match(model, broken, max_new_tokens=5, stop_token_ids=unused) == (0.5, 4)
    model.train()
    exact_match(model, samples[:1], max_new_tokens=1)
    assert model.training  # the trainer's mode is restored
    model.eval()


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory, repo):
    """Project weights of a tiny random model with the demo tokenizer."""
    from mimir_megatron.interop import save_weights

    tokenizer = repo / "data_prep" / "mimir_data_prep" / "demo" / "tokenizer"
    model = build_model(tiny_config("vocab_size=1024", f"tokenizer={tokenizer}", "seed=3"))
    return save_weights(model, tmp_path_factory.mktemp("weights") / "tiny")


def test_generate_command_writes_one_line_per_input(text_model_dir, tmp_path):
    from mimir_megatron.cli import main

    lines = [
        json.dumps({"prompt": "Hello there", "id": "a"}),
        json.dumps({"messages": [{"role": "user", "content": "Reverse: abc"}]}),
        "{not json",
        json.dumps({"prompt_ids": [1, 2, 99999]}),
        json.dumps({"prompt_ids": [5, 6, 7]}),
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    rc = main(["generate", "--weights", str(text_model_dir), "--input", str(tmp_path / "in.jsonl"),
               "--output", str(out), "--max-new-tokens", "5", "--logprobs"])
    assert rc == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == 5 and got[0]["id"] == "a"
    assert "line 3" in got[2]["error"] and "line 4" in got[3]["error"] and "vocabulary" in got[3]["error"]
    for row in (got[0], got[1], got[4]):
        assert row["finish_reason"] in ("stop", "length") and 1 <= len(row["completion_ids"]) <= 5
        assert isinstance(row["completion"], str) and len(row["logprobs"]) == len(row["completion_ids"])
    # the chat line is rendered with the template up to the generation prompt
    from mimir_megatron.inference import load_engine

    engine = load_engine(weights=text_model_dir)
    ids = engine.render_chat([{"role": "user", "content": "Reverse: abc"}])
    assert engine.decode(ids).endswith("model\n")
    again = engine.generate([GenerationRequest(ids, SamplingParams(max_new_tokens=5))])[0]
    assert again.token_ids == got[1]["completion_ids"]


def test_generating_a_jsonl_file_is_a_function_of_typed_arguments(text_model_dir, tmp_path):
    """`mimir generate`'s workflow without the CLI: a mistyped input fails before the engine is
    loaded; a bad line is written with its error; line i samples with seed + i - 1."""
    from dataclasses import replace

    from mimir_megatron.errors import UserError
    from mimir_megatron.inference import load_engine
    from mimir_megatron.inference.jsonl import generate_jsonl

    loads = []
    with pytest.raises(UserError, match="input file not found"):
        generate_jsonl(lambda: loads.append(1), tmp_path / "missing.jsonl", tmp_path / "out.jsonl")
    assert loads == [] and not (tmp_path / "out.jsonl").exists()
    engine = load_engine(weights=text_model_dir)
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt_ids": [5, 6, 7], "id": "x"}) + "\n\n"
                                       + json.dumps({"prompt": 3}) + "\n" + json.dumps({"prompt_ids": [8, 9]}) + "\n")
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=10)
    done = generate_jsonl(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", sampling, logprobs=True)
    assert (done.lines, done.generated, done.bad) == (3, 2, 1)
    got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert got[0]["id"] == "x" and got[1] == {"prompt": 3, "error": "line 3: prompt must be a string"}
    for row, ids, number in ((got[0], [5, 6, 7], 1), (got[2], [8, 9], 4)):
        again = engine.generate([GenerationRequest(ids, replace(sampling, seed=10 + number - 1))])[0]
        assert row["completion_ids"] == again.token_ids and len(row["logprobs"]) == len(again.token_ids)

def test_engine_loads_a_training_checkpoint_and_its_ema(demo_data, tmp_path):
    """The engine reads a checkpoint without the trainer; the reference is the training-state
    loader (resume's path) into a model built from the run's own config."""
    from conftest import REPO, train_overrides

    from mimir_megatron.checkpoint import load_checkpoint
    from mimir_megatron.inference import load_engine
    from mimir_megatron.model import build_model
    from mimir_megatron.model.state import gather_full_state
    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.loop import train
    from mimir_megatron.train.optim import EMA

    cfg = load_train_config(REPO / "configs/train/demo.yaml",
                            train_overrides(demo_data, tmp_path, "train.steps=3", "optim.ema_decay=0.5"))
    train(cfg)
    checkpoints = tmp_path / "checkpoints"
    for ema in (False, True):
        engine = load_engine(checkpoint=checkpoints, ema=ema)  # follows `latest`
        ours = gather_full_state(engine.model)
        reference = build_model(cfg.model)
        averaged = EMA(reference, decay=0.0)
        load_checkpoint(checkpoints / "step_0000003", reference, None, averaged, restore_rng=False)
        if ema:
            averaged.copy_to(reference)
        ref = gather_full_state(reference)
        assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ours)
        assert engine.tokenizer is not None and engine.model_name == "checkpoints"
    raw, averaged = (gather_full_state(load_engine(checkpoint=checkpoints, ema=e).model) for e in (False, True))
    assert not torch.equal(raw["head.weight"], averaged["head.weight"])
    text = load_engine(checkpoint=checkpoints).generate(
        [GenerationRequest([1, 2, 3], SamplingParams(max_new_tokens=3))])[0]
    assert len(text.token_ids) <= 3 and isinstance(text.text, str)


def test_evaluation_stops_on_the_templates_end_of_turn(demo_data, repo):
    """Held-out evaluation stops on the end-of-turn ids its dataset's manifest records, and the
    engine's default stops are the same ids (not a guessed token list)."""
    from mimir_megatron.chat import load_tokenizer

    from mimir_megatron.train.evaluate import eval_stop_ids

    tokenizer = load_tokenizer(repo / "data_prep" / "mimir_data_prep" / "demo" / "tokenizer")
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert eval_stop_ids(demo_data / "eval") == (end_of_turn,)
    engine = InferenceEngine(build_model(tiny_config("vocab_size=1024")), tokenizer)
    assert engine.default_stop_ids == (end_of_turn,)
