"""`mimir audit index | prefix | continuation | contamination`: the memorisation and
contamination audits."""

from __future__ import annotations

import argparse
import logging

from mimir_megatron.checkpoint import add_model_arguments, model_dir_from_args

log = logging.getLogger("mimir.audit")


def register(sub: argparse._SubParsersAction) -> None:
    audit = sub.add_parser("audit", help="memorisation and contamination audits of the training data")
    asub = audit.add_subparsers(dest="audit_command", required=True, metavar="AUDIT")

    p = asub.add_parser("index", help="build the exact-match index (suffix arrays) of the training data")
    _add_sources(p)
    p.add_argument("--output", required=True, help="index directory to write (a rerun resumes)")
    p.add_argument("--shard-tokens", type=float, default=float(1 << 30),
                   help="tokens per index shard (default 2^30)")
    p.add_argument("--mem-gib", type=float, default=8.0, help="memory for suffix-array sorting (GiB)")
    p.add_argument("--cpus", type=int, help="parallel sorting jobs (default: all cores)")
    p.add_argument("--encoding", default="auto", choices=["auto", "u16", "u16x2"],
                   help="symbols per token: auto picks u16 for vocabularies < 65,500")
    p.set_defaults(handler=cmd_index, extra="audit", setup="megatron")

    p = asub.add_parser("prefix",
                        help="audit 1: longest verbatim span of greedy outputs (Table 11, Figure 2)")
    _add_model(p)
    p.add_argument("--index", required=True, help="index directory from `mimir audit index`")
    p.add_argument("--categories", required=True, help="comma-separated audit categories, e.g. A,B,C,D")
    p.add_argument("--per-category", type=int, default=500,
                   help="documents audited per category (default 500)")
    p.add_argument("--generic", help="JSONL of generic prompts (prompt_ids, messages or prompt)")
    p.add_argument("--prefix-tokens", type=int, default=50,
                   help="prompt length cut from each document (default 50)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="greedy tokens generated per prompt (default 128)")
    p.add_argument("--min-match", type=int, default=10,
                   help="shortest span that counts a document as matched (tokens)")
    p.add_argument("--long-match", type=int, default=50, help="the long-match threshold (tokens)")
    p.add_argument("--max-hits", type=int, default=10_000, help="documents listed per span, at most")
    p.add_argument("--position", choices=["start", "random"], default="start",
                   help="where the prefix is cut from the document")
    p.set_defaults(handler=cmd_prefix, extra="audit", setup="megatron")

    p = asub.add_parser("continuation",
                        help="audit 2: the greedy 64+64 exact-continuation protocol (Table 12)")
    _add_model(p)
    _add_sources(p, allow_index=True)
    p.add_argument("--samples", type=int, default=1000, help="windows per category")
    p.add_argument("--categories", help="comma-separated audit categories (default: all)")
    p.add_argument("--prefix-tokens", type=int, default=64, help="prompt length of each window (default 64)")
    p.add_argument("--continuation-tokens", type=int, default=64,
                   help="tokens that must continue the window exactly (default 64)")
    p.add_argument("--method", choices=["score", "generate"], default="score",
                   help="score: one forward pass per window (same verdict); generate: decode and compare")
    p.add_argument("--mask", choices=["prompt", "training"], default="prompt",
                   help="prompt: the window is a bidirectional prompt (the paper's protocol); training: "
                   "also score each window with the mask it had in training (bidirectional only where "
                   "it lay in its document's prompt) and report both rates side by side")
    p.set_defaults(handler=cmd_continuation, extra="audit", setup="megatron")


    p = asub.add_parser(
        "contamination", help="benchmark items against the training data's index (n-gram overlap; denylist)",
        description="Checks every item of an evaluation suite (the row values its prompt shows and its "
        "reference answers, tokenised as `mimir prepare` tokenises text) against the index: an item is "
        "contaminated when --ngram consecutive tokens of it occur in one training document, exactly or "
        "with other whitespace between the words. Writes OUTPUT/<suite>.json (read by `mimir eval` and "
        "`mimir sweep`), .md, .csv and <suite>_items.jsonl, logs to MLflow, and with --denylist writes the "
        "file `mimir prepare --denylist` drops the overlapping documents with (docs/contamination.md).")
    p.add_argument("--suite", required=True, help="suite YAML, e.g. configs/eval/mimir_en.yaml")
    p.add_argument("--index", required=True, help="index directory from `mimir audit index`")
    p.add_argument("--output", required=True,
                   help="directory for the report (a training run's RUN/contamination is where eval and "
                        "sweep of its checkpoints look)")
    p.add_argument("--data-dir", help="directory the tasks' files are under (default: the suite's data_dir)")
    p.add_argument("--tasks", help="comma-separated subset of the suite's tasks")
    p.add_argument("--limit", type=int,
                   help="first N items of each task after the seeded shuffle (default: all)")
    p.add_argument("--tokenizer", help="the training data's tokenizer (default: the one the index records); "
                   "checked against the index")
    p.add_argument("--ngram", type=int, default=13,
                   help="overlap length in tokens that makes an item contaminated (default 13: GPT-3's 13, "
                        "later work 8-13; shorter flags boilerplate, longer misses paraphrase)")
    p.add_argument("--max-hits", type=int, default=1000,
                   help="training documents listed per overlap, at most (the denylist drops them all)")
    p.add_argument("--denylist", help="also write this denylist for `mimir prepare --denylist`")
    p.add_argument("--workers", type=int, help="lookup threads (default: all cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--tracking-uri",
                   help="MLflow store (default: sqlite:///OUTPUT/mlflow.db, artifacts in OUTPUT/mlartifacts)")
    p.add_argument("--experiment", default="mimir-audit", help="MLflow experiment")
    p.set_defaults(handler=cmd_contamination, extra="audit", setup="megatron")


def _add_sources(p: argparse.ArgumentParser, allow_index: bool = False) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--mixture", help="mixture YAML (audit group: audit_category, else category)")
    g.add_argument("--data", nargs="+", metavar="[CATEGORY=]DIR", help="prepared dataset directories")
    if allow_index:
        g.add_argument("--index", help="the datasets of an audit index")


def _add_model(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--tokenizer", help="tokenizer directory (default: the one found with the model)")
    p.add_argument("--batch-size", type=int, default=32, help="rows decoded or scored together (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seeds the choice of documents and windows")
    p.add_argument("--output", required=True, help="directory for tables, figures and JSONL")
    p.add_argument("--tracking-uri",
                   help="MLflow store (default: sqlite:///OUTPUT/mlflow.db, artifacts in OUTPUT/mlartifacts)")
    p.add_argument("--experiment", default="mimir-audit", help="MLflow experiment")


def _categories(text: str | None) -> list[str] | None:
    if not text:
        return None
    return [c.strip() for c in text.split(",") if c.strip()]


def cmd_index(args: argparse.Namespace) -> int:
    from mimir_megatron.audits.index_build import build_index
    from mimir_megatron.audits.index_query import AuditIndex
    from mimir_megatron.audits.sources import resolve_sources

    sources = resolve_sources(args.mixture, args.data)
    out = build_index(sources, args.output, shard_tokens=int(args.shard_tokens),
                      mem_bytes=int(args.mem_gib * 2**30), cpus=args.cpus, encoding=args.encoding)
    index = AuditIndex(out)
    log.info("%s: %d documents, %d tokens, %d shard(s), encoding %s", out, index.num_documents,
             index.num_tokens, len(index.metadata.shards), index.encoding)
    return 0


def _params(args: argparse.Namespace) -> dict:
    """The command line, as the audit's MLflow params."""
    return {k: v for k, v in vars(args).items() if k != "handler"}


def cmd_prefix(args: argparse.Namespace) -> int:
    from mimir_megatron.audits.prefix import PrefixSettings, prefix_audit
    from mimir_megatron.audits.outputs import audit_tracking

    source = model_dir_from_args(args)
    settings = PrefixSettings(
        categories=_categories(args.categories) or [], per_category=args.per_category,
        prefix_tokens=args.prefix_tokens, max_new_tokens=args.max_new_tokens, min_match=args.min_match,
        long_match=args.long_match, max_hits=args.max_hits, position=args.position, seed=args.seed,
        batch_size=args.batch_size)
    tracking = audit_tracking(args.output, source, args.tracking_uri, args.experiment)
    result = prefix_audit(source, args.index, args.output, settings, generic=args.generic, ema=args.ema,
                          tokenizer=args.tokenizer, params=_params(args), tracking=tracking)
    print(result.table.read_text())
    return 0


def cmd_continuation(args: argparse.Namespace) -> int:
    from mimir_megatron.audits.continuation import ContinuationSettings, continuation_audit
    from mimir_megatron.audits.outputs import audit_tracking
    from mimir_megatron.audits.sources import resolve_sources

    if args.index:
        from mimir_megatron.audits.index_query import AuditIndex

        sources = AuditIndex(args.index).audit_sources
    else:
        sources = resolve_sources(args.mixture, args.data)
    source = model_dir_from_args(args)
    settings = ContinuationSettings(
        categories=_categories(args.categories), samples=args.samples, prefix_tokens=args.prefix_tokens,
        continuation_tokens=args.continuation_tokens, method=args.method, mask=args.mask, seed=args.seed,
        batch_size=args.batch_size)
    tracking = audit_tracking(args.output, source, args.tracking_uri, args.experiment)
    result = continuation_audit(source, sources, args.output, settings, ema=args.ema,
                                tokenizer=args.tokenizer, params=_params(args), tracking=tracking)
    print(result.table.read_text())
    return 0


def cmd_contamination(args: argparse.Namespace) -> int:
    import os

    from mimir_megatron.audits.contamination import ContaminationSettings
    from mimir_megatron.audits.contamination_audit import contamination_audit
    from mimir_megatron.audits.outputs import audit_tracking

    settings = ContaminationSettings(ngram=args.ngram, max_hits=args.max_hits, limit=args.limit,
                                     workers=args.workers or max(1, len(os.sched_getaffinity(0))))
    result = contamination_audit(
        args.suite, args.index, args.output, settings, tasks=_categories(args.tasks), data_dir=args.data_dir,
        tokenizer=args.tokenizer, denylist=args.denylist, progress=not args.no_progress, params=_params(args),
        tracking=audit_tracking(args.output, None, args.tracking_uri, args.experiment))
    print(result.table.read_text())
    return 1 if result.errors else 0
