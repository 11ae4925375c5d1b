"""Proof that the audits find what is there: a tiny model trained on the demo data plus planted
canaries (random token sequences, repeated many times) must reproduce the canaries verbatim
(>= 50 tokens) in the prefix audit, and must not be reported for the controls: documents of the
same kind that are in the index but were never trained on."""

from __future__ import annotations


import numpy as np
import pytest
from audit_support import write_prepared
from conftest import REPO, train_overrides

pytestmark = pytest.mark.slow

N_CANARIES = 4
PROMPT, CONTINUATION = 50, 80
CANARY_IDS = (800, 832)  # a small id range of the 1,024-id demo vocabulary: quick to memorise


def random_documents(rng, n):
    return [(rng.integers(*CANARY_IDS, PROMPT).tolist(), rng.integers(*CANARY_IDS, CONTINUATION).tolist())
            for _ in range(n)]


@pytest.fixture(scope="module")
def trained(demo_data, tmp_path_factory):
    from mimir_megatron.audits import AuditIndex, build_index, resolve_sources
    from mimir_megatron.audits.model import EngineAuditModel
    from mimir_megatron.inference import load_engine
    from mimir_megatron.train.config import load_train_config
    from mimir_megatron.train.loop import train

    root = tmp_path_factory.mktemp("canaries")
    rng = np.random.default_rng(0)
    write_prepared(root / "canary", random_documents(rng, N_CANARIES))
    write_prepared(root / "control", random_documents(rng, N_CANARIES))
    # a tenth of the demo data per epoch: the canaries get most of a short run's steps (at 100 steps
    # every canary comes back whole, 80 of 80 tokens, at 1, 2 and 4 threads; at 80 steps one does not)
    demo_lines = [line.replace("repeat: 1}", "repeat: 0.1}")
                  for line in (demo_data / "mixture.yaml").read_text().splitlines()[2:]]
    trained_on = ["name: canary-train", "datasets:", *demo_lines,
                  f"  - {{name: canary, path: {root / 'canary'}, category: x, language: en, repeat: 40}}"]
    (root / "train.yaml").write_text("\n".join(trained_on) + "\n")
    # the index covers the controls too: a broken audit that matched prompts would report them
    indexed = [*trained_on[:-1], trained_on[-1].replace("category: x", "category: x, audit_category: canary"),
               f"  - {{name: control, path: {root / 'control'}, category: x, audit_category: control}}"]
    indexed = [line.replace("category: demo,", "category: demo, audit_category: demo,") for line in indexed]
    (root / "index.yaml").write_text("\n".join(indexed) + "\n")

    cfg = load_train_config(REPO / "configs" / "train" / "demo.yaml", train_overrides(
        demo_data, root / "run", f"data.mixture={root / 'train.yaml'}", "train.steps=100", "optim.lr=3e-3",
        "data.seq_len=256", "train.global_batch_size=8", "train.micro_batch_size=8", "optim.warmup_steps=10",
        "optim.ema_decay=0.0", "optim.weight_decay=0.0", "checkpoint.interval=100", "window.ramp_fraction=0.2"))
    result = train(cfg)
    index = AuditIndex(build_index(resolve_sources(mixture=str(root / "index.yaml")), root / "idx", progress=False))
    model = EngineAuditModel(load_engine(checkpoint=result.checkpoint))
    return model, index, root


def test_prefix_audit_finds_the_canaries_and_not_the_controls(trained):
    from mimir_megatron.audits.prefix import PrefixSettings, run_prefix_audit

    model, index, _ = trained
    settings = PrefixSettings(categories=["canary", "control"], per_category=N_CANARIES, prefix_tokens=PROMPT,
                              max_new_tokens=CONTINUATION, seed=0)
    rows, outcomes, _ = run_prefix_audit(model, index, settings, progress=False)
    by = {r["setting"]: r for r in rows}
    canaries = [o for o in outcomes if o.setting == "canary"]
    controls = [o for o in outcomes if o.setting == "control"]
    assert len(canaries) == len(controls) == N_CANARIES
    for o in canaries:  # the continuation, verbatim, found in the canary's own document
        assert o.span_length >= 50 and o.reproduces_source, o
        assert any(h.source == "canary" and h.document == o.document and h.offset >= PROMPT
                   for h in index.locate(o.output_ids[o.span_start:o.span_start + o.span_length]))
    assert by["Prefix canary"]["matches >= 50 tokens"] == N_CANARIES
    assert by["Prefix canary"]["outputs with a >= 50-token span"] == N_CANARIES
    for o in controls:
        assert o.span_length < 50 and not o.reproduces_source, o
    assert by["Prefix control"]["matches >= 50 tokens"] == 0
    assert by["Prefix control"]["outputs with a >= 50-token span"] == 0


def test_continuation_protocol_finds_the_canaries_and_score_agrees_with_generate(trained):
    """Windows of 50 + 64 tokens: those at offset 0 are the trained (prompt, response) and must
    match exactly; controls never; and scoring must give the same verdict as decoding."""
    from mimir_megatron.audits.continuation import ContinuationSettings, run_continuation_audit

    model, index, _ = trained
    sources = index.audit_sources
    found = {}
    for method in ("score", "generate"):
        settings = ContinuationSettings(categories=["canary", "control"], samples=1000, prefix_tokens=PROMPT,
                                        continuation_tokens=64, method=method, seed=0)
        rows, matches, _ = run_continuation_audit(model, sources, settings, progress=False)
        found[method] = {(m.source, m.document, m.offset) for m in matches}
        by = {r["category"]: r for r in rows}
        assert by["canary"]["evaluations"] == by["control"]["evaluations"] == N_CANARIES * 17  # every window
        assert by["control"]["exact matches"] == 0
        assert {("canary", d, 0) for d in range(N_CANARIES)} <= found[method]
    assert found["score"] == found["generate"]


def test_training_mask_finds_every_window_that_greedy_decoding_reproduces_under_that_mask(trained, tmp_path):
    """`--mask training`: each window is scored with the mask it had in training (bidirectional
    only on the tokens that lay in the canary's prompt). The reference is independent:
    transformers' hrm_text decodes every window greedily with token_type_ids = 1 on exactly
    those tokens. The two sets of reproduced windows must be equal; the paper's protocol (the
    whole window bidirectional) is reported beside it."""
    transformers = pytest.importorskip("transformers")
    import torch

    from mimir_megatron.audits.continuation import ContinuationSettings, run_continuation_audit
    from mimir_megatron.audits.sampling import CategoryDocuments, sample_windows
    from mimir_megatron.interop import export_hf

    model, index, _ = trained
    sources = index.audit_sources
    settings = ContinuationSettings(categories=["canary"], samples=1000, prefix_tokens=PROMPT,
                                    continuation_tokens=64, mask="training", seed=0)
    rows, paper, training = run_continuation_audit(model, sources, settings, progress=False)

    probes = sample_windows(CategoryDocuments(sources, "canary"), 1000, PROMPT, 64, seed=0)
    assert len(probes) == N_CANARIES * 17
    assert [p.prompt_in_document_prompt for p in probes] == [max(PROMPT - p.offset, 0) for p in probes]
    export_hf(model.engine.model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.tensor([p.prompt_ids for p in probes])
    types = torch.zeros_like(ids)
    for row, p in enumerate(probes):
        types[row, :p.prompt_in_document_prompt] = 1
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=types,
                          max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
    reproduced = {(p.source, p.document, p.offset) for p, o in zip(probes, out)
                  if o[PROMPT:].tolist() == p.continuation_ids}
    assert reproduced  # the canaries are memorised: at least their trained (prompt, response) windows
    assert {(m.source, m.document, m.offset) for m in training} == reproduced
    by = {r["category"]: r for r in rows}
    assert by["canary"]["exact matches, training mask"] == len(reproduced)
    assert by["canary"]["exact matches"] == len(paper)
    print(f"canary windows reproduced: paper protocol {len(paper)}/{len(probes)}, "
          f"training mask {len(training)}/{len(probes)}")
