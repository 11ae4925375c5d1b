"""Subcommands `mimir prepare`, `mimir data {report,demo,demo-tokenizer,pack}` and `mimir synth`."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

# `mimir synth ACTION`: each module listed here exposes ``register_synth(subparsers)`` and adds its
# actions to the group (heavy imports inside the handlers). A new action adds its module here.
SYNTH_REGISTRARS = ("mimir_data_prep.tool_use.cli", "mimir_data_prep.synth_pipeline.cli")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize chat JSONL/Parquet into Megatron indexed datasets",
        description="Render conversations with a tokenizer's chat template and write a prepared "
        "dataset directory (shards/*.bin|.idx, manifest.json, rejects.jsonl).",
    )
    p.add_argument("--input", "-i", nargs="+", help="JSONL or Parquet files")
    p.add_argument("--tokenizer", "-t", help="Hugging Face tokenizer directory")
    p.add_argument("--output", "-o", help="output directory")
    p.add_argument(
        "--config",
        default=None,
        help="YAML listing several datasets (input, output, input_format, columns each); "
        "replaces -i/-t/-o (see data_prep/mimir_data_prep/prepare_config.py)",
    )
    p.add_argument("--seq-len", type=int, default=4096, help="context length (default 4096)")
    p.add_argument(
        "--too-long",
        choices=("drop", "truncate-prefix"),
        default="drop",
        help="what to do with samples longer than the context (default drop)",
    )
    p.add_argument("--min-response-tokens", type=int, default=2)
    p.add_argument(
        "--input-format",
        choices=("auto", "messages", "sharegpt", "alpaca", "columns"),
        default="auto",
        help="input layout; auto decides per file from its first lines (default auto)",
    )
    p.add_argument(
        "--columns",
        default=None,
        metavar="TARGET=COLUMN,...",
        help="column mapping for the columns layout, e.g. prompt=problem,completion=generated_solution "
        "(targets: prompt, completion, system, messages, tools)",
    )
    p.add_argument(
        "--control-chars",
        choices=("reject", "strip"),
        default="reject",
        help="lines with NUL or other control characters: reject them (default) or strip the characters",
    )
    p.add_argument(
        "--denylist",
        default=None,
        metavar="FILE",
        help="drop documents holding benchmark text that `mimir audit contamination --denylist` found "
        "(rejected as benchmark_overlap; docs/contamination.md)",
    )
    p.add_argument(
        "--personal-data",
        choices=("reject", "redact", "report"),
        default=None,
        help="documents holding personal data (e-mail, phone, IBAN, payment card, national id incl. "
        "the Danish "
        "CPR, IP address): reject those with a direct identifier (default), redact every one found, or only "
        "report the counts (the manifest's personal_data; docs/data-governance.md); with --config it "
        "replaces the file's setting",
    )
    p.add_argument("--strict", action="store_true", help="stop at the first bad line")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default: cores)")
    p.add_argument("--shard-mb", type=float, default=64.0, help="JSONL shard size in MiB")
    p.add_argument("--part", default=None, metavar="I/N|START:END",
                   help="prepare only these shards (the I-th of N ranges from 0, or shard ids START:END) and "
                   "write no manifest: one job of a Slurm array (launchers/prepare_array.sh)")
    p.add_argument("--merge", action="store_true",
                   help="after every --part finished: check all shards are there and write the manifest")
    p.add_argument("--no-progress", action="store_true")
    _add_provenance_flags(p)
    p.set_defaults(handler=_prepare)

    data = sub.add_parser("data", help="demo data, mixture reports, packing index")
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")

    r = dsub.add_parser("report", help="tokens per epoch by category/language (Tables 1 and 8)")
    r.add_argument("--mixture", "-m", required=True, help="mixture YAML")
    r.add_argument("--top", type=int, default=10, help="datasets in the top list (default 10)")
    r.set_defaults(handler=_report)

    d = dsub.add_parser("demo", help="generate and prepare the bilingual demo data set")
    d.add_argument("--output", "-o", default="data/demo", help="output directory (default data/demo)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--train-per-group", type=int, default=3000)
    d.add_argument("--eval-per-group", type=int, default=100)
    d.add_argument("--tokenizer", default=None, help="default: the bundled demo tokenizer")
    d.add_argument("--seq-len", type=int, default=256)
    d.add_argument("--workers", type=int, default=None)
    d.add_argument("--no-prepare", action="store_true", help="only write the raw JSONL files")
    d.set_defaults(handler=_demo)

    t = dsub.add_parser("demo-tokenizer", help="retrain the demo tokenizer (deterministic)")
    t.add_argument("--output", "-o", default=None, help="default: data_prep/mimir_data_prep/demo/tokenizer")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(handler=_demo_tokenizer)

    v = dsub.add_parser(
        "declare", help="record the provenance of raw data files (a sidecar that prepare and synth read)",
        description="Write FILE.provenance.json beside each file: the provenance `mimir prepare`, "
        "`mimir synth tools` and `mimir synth run` take for data made from it (docs/data-governance.md).")
    v.add_argument("files", nargs="+", help="JSONL or Parquet files")
    _add_provenance_flags(v)
    v.set_defaults(handler=_declare)

    g = dsub.add_parser("keygen", help="make an Ed25519 key pair for signing manifests",
                        description="Write KEY (private, mode 0600) and KEY.pub; a mixture's "
                        "data_policy.public_key: KEY.pub then trains only on manifests signed with KEY.")
    g.add_argument("--output", required=True, metavar="KEY", help="the private key file to create")
    g.set_defaults(handler=_keygen)
    s = dsub.add_parser("sign", help="sign prepared datasets' manifests (manifest.sig)")
    s.add_argument("datasets", nargs="+", help="prepared dataset directories")
    s.add_argument("--key", required=True, help="the private key (mimir data keygen)")
    s.set_defaults(handler=_sign)

    k = dsub.add_parser("pack", help="build and cache the packing index ahead of training")
    k.add_argument("--mixture", "-m", required=True)
    k.add_argument("--seq-len", type=int, default=4096)
    k.add_argument("--seed", type=int, default=1234)
    k.add_argument("--pack-window", type=int, default=16384)
    k.add_argument("--index-dir", default=None)
    k.add_argument("--epochs", type=int, default=1, help="epochs to index (default 1)")
    k.add_argument("--workers", type=int, default=None,
                   help="processes packing an epoch's windows (default: the cores; the index is the same)")
    k.set_defaults(handler=_pack)

    register_synth_group(sub)


# --flag -> ProvenanceDeclaration field (docs/data-governance.md explains each).
PROVENANCE_FLAGS = {
    "provenance_id": "id", "source": "source", "source_location": "location",
    "source_revision": "revision", "retrieved": "retrieved", "license": "license", "basis": "basis",
    "form": "form", "audit_group": "audit_group", "language": "languages",
    "derived_from": "derived_from", "generator": "generator", "generator_license": "generator_license",
    "research_organisation": "research_organisation", "lawful_access": "lawful_access",
    "derived_terms": "derived_terms",
}


def _add_provenance_flags(p: argparse.ArgumentParser) -> None:
    from mimir_megatron.data.provenance import BASES, FORMS

    g = p.add_argument_group(
        "provenance", "where the data came from and on which basis it may be used (stored in the "
        "manifest; without it the dataset's provenance is 'unknown', which the default data policy "
        "refuses to train on). With --config: a provenance section per dataset instead")
    g.add_argument("--provenance-id",
                   help="the id other datasets' --derived-from name (default: the output name)")
    g.add_argument("--source", help="the source's name, e.g. OpenMathInstruct-2")
    g.add_argument("--source-location", help="a URL, or a Hugging Face Hub repo id (owner/name)")
    g.add_argument("--source-revision", help="the revision or version retrieved")
    g.add_argument("--retrieved", help="the retrieval date, YYYY-MM-DD")
    g.add_argument("--license", help="an SPDX expression (CC-BY-4.0, Apache-2.0 AND MIT), public-domain "
                   "or proprietary-agreement; inherited from --derived-from when omitted")
    g.add_argument("--basis", choices=tuple(BASES), help="the permission basis")
    g.add_argument("--form", choices=tuple(FORMS), help="the form the data entered the corpus in (Table 6)")
    g.add_argument("--audit-group",
                   help="memorisation-audit group by opt-out status (the paper's A-D, or yours)")
    g.add_argument("--language", action="append", help="an ISO 639 code; repeat for several")
    g.add_argument("--derived-from", action="append", metavar="PATH",
                   help="a prepared dataset, or a file with a provenance sidecar, this data was made from; "
                   "repeat")
    g.add_argument("--generator", help="the models or programs that generated synthetic data")
    g.add_argument("--generator-license",
                   help="the generator models' terms (an SPDX expression); they bind synthetic data too")
    g.add_argument("--research-organisation",
                   help="basis tdm-research: the research organisation mining the data (DSM Art. 3)")
    g.add_argument("--lawful-access",
                   help="basis tdm-research: how the organisation has lawful access to the works")
    g.add_argument("--derived-terms",
                   help="basis agreement: the licence the agreement lets derived data be used under "
                   "(synthetic data made from it takes these terms)")


def provenance_from_flags(args: argparse.Namespace, default_id: str):
    """The resolved provenance of ``mimir prepare``'s flags; None when none was given."""
    from mimir_megatron.config import raise_errors
    from mimir_megatron.data.provenance import ProvenanceDeclaration, resolve_declaration

    given = {field: getattr(args, flag) for flag, field in PROVENANCE_FLAGS.items() if getattr(args, flag)}
    if not given:
        return None
    errors: list[str] = []
    provenance = resolve_declaration(ProvenanceDeclaration(**given), "provenance", default_id=default_id,
                                     base=Path.cwd(), errors=errors)
    # Name the flag a mistake is in: "provenance.license: ..." -> "--license: ...".
    flag_of = {field: f"--{flag.replace('_', '-')}" for flag, field in PROVENANCE_FLAGS.items()}
    raise_errors([re.sub(r"^provenance\.([a-z_]+)", lambda m: flag_of.get(m.group(1), m.group(0)), e)
                  for e in errors], "invalid provenance")
    return provenance


def register_synth_group(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The `mimir synth` group, filled by every module in SYNTH_REGISTRARS; returns its subparsers."""
    synth = sub.add_parser("synth", help="build training data: convert tool-use traces, generate and audit")
    ssub = synth.add_subparsers(dest="synth_command", required=True, metavar="ACTION")
    for module_name in SYNTH_REGISTRARS:
        importlib.import_module(module_name).register_synth(ssub)
    return ssub


def _prepare(args: argparse.Namespace) -> int:
    from mimir_megatron.errors import UserError

    if args.part and args.merge:
        raise UserError("--part prepares a range of shards, --merge assembles them afterwards: give one")
    if args.config:
        if args.part or args.merge:
            raise UserError("--part/--merge prepare one dataset over several jobs: "
                            "use -i/-t/-o, not --config")
        if args.input or args.output or args.tokenizer:
            raise UserError("--config names inputs, outputs and the tokenizer; drop -i/-o/-t")
        flags = [f"--{flag.replace('_', '-')}" for flag in PROVENANCE_FLAGS if getattr(args, flag)]
        if flags:
            raise UserError("--config declares provenance per dataset (a provenance section); "
                            f"drop {', '.join(flags)}")
        from .prepare_config import run_prepare_config

        run_prepare_config(args.config, progress=not args.no_progress, workers=args.workers,
                           denylist=args.denylist, personal_data=args.personal_data)
        return 0
    missing = [
        flag for flag, value in (("-i", args.input), ("-t", args.tokenizer), ("-o", args.output)) if not value
    ]
    if missing:
        raise UserError(f"mimir prepare needs {', '.join(missing)} (or --config FILE.yaml)")
    provenance = provenance_from_flags(args, default_id=Path(args.output).name)
    from .prepare import prepare

    prepare(
        args.input,
        args.tokenizer,
        args.output,
        seq_len=args.seq_len,
        too_long=args.too_long,
        min_response_tokens=args.min_response_tokens,
        strict=args.strict,
        input_format=args.input_format,
        columns=args.columns,
        control_chars=args.control_chars,
        workers=args.workers,
        shard_bytes=max(1, int(args.shard_mb * 1024 * 1024)),
        progress=not args.no_progress,
        provenance=provenance,
        denylist=args.denylist,
        personal_data=args.personal_data or "reject",
        part=args.part,
        merge=args.merge,
    )
    return 0


def _declare(args: argparse.Namespace) -> int:
    from mimir_megatron.data.provenance import write_sidecar
    from mimir_megatron.errors import UserError

    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        raise UserError(f"input file not found: {missing[0]}")
    for path in args.files:
        provenance = provenance_from_flags(args, default_id=Path(path).name.split(".")[0])
        if provenance is None:
            raise UserError("mimir data declare needs the provenance flags "
                            "(--source, --license, --basis, --form)")
        print(f"{path}: {write_sidecar(path, provenance)}")
    return 0


def _keygen(args: argparse.Namespace) -> int:
    from mimir_megatron.data.signing import generate_key

    private, public = generate_key(args.output)
    print(f"private key: {private}\npublic key:  {public}")
    return 0


def _sign(args: argparse.Namespace) -> int:
    from mimir_megatron.data.signing import sign_manifest

    for dataset in args.datasets:
        print(f"{dataset}: {sign_manifest(dataset, args.key)}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from .report import report

    print(report(args.mixture, args.top))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo_data import write_demo
    from .demo_tokenizer import DEMO_TOKENIZER_DIR

    out = Path(args.output)
    train_paths, eval_path = write_demo(out, args.seed, args.train_per_group, args.eval_per_group)
    log.info("wrote %d train files and %s", len(train_paths), eval_path)
    if args.no_prepare:
        return 0
    from .demo_data import demo_provenance
    from .prepare import prepare

    tokenizer = args.tokenizer or DEMO_TOKENIZER_DIR
    for path in train_paths + [eval_path]:
        prepare(
            [path],
            tokenizer,
            out / path.stem,
            seq_len=args.seq_len,
            workers=args.workers or 1,
            progress=False,
            provenance=demo_provenance(path.stem),
        )
    return 0


def _demo_tokenizer(args: argparse.Namespace) -> int:
    from .demo_tokenizer import DEMO_TOKENIZER_DIR, train_demo_tokenizer

    out = train_demo_tokenizer(Path(args.output) if args.output else DEMO_TOKENIZER_DIR, args.seed)
    log.info("demo tokenizer written to %s", out)
    return 0


def _pack(args: argparse.Namespace) -> int:
    from mimir_megatron.data import DataConfig, PackedMixture, padding_fraction

    cfg = DataConfig(
        mixture=args.mixture,
        seq_len=args.seq_len,
        seed=args.seed,
        pack_window=args.pack_window,
        index_dir=args.index_dir,
    )
    stream = PackedMixture(cfg)
    workers = args.workers or len(os.sched_getaffinity(0))
    for epoch in range(args.epochs):
        index = stream.epoch(epoch, workers)
        pad = padding_fraction(index, stream.sample_lengths, cfg.seq_len)
        print(f"epoch {epoch}: {index.num_contexts:,} contexts, padding {100 * pad:.2f} %")
    print(f"index cached in {stream.index_dir}")
    return 0
