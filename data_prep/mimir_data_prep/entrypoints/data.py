"""`mimir data ACTION`: demo data, mixture reports, provenance sidecars, manifest signing and the
packing index. Each action calls one library function."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from .provenance_flags import add_provenance_flags, provenance_from_flags

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="demo data, mixture reports, provenance, signing, packing index")
    dsub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")

    r = dsub.add_parser("report", help="tokens per epoch by category/language (Tables 1 and 8)")
    r.add_argument("--mixture", "-m", required=True, help="mixture YAML")
    r.add_argument("--top", type=int, default=10, help="datasets in the top list (default 10)")
    r.set_defaults(handler=cmd_report)

    d = dsub.add_parser("demo", help="generate and prepare the bilingual demo data set")
    d.add_argument("--output", "-o", default="data/demo", help="output directory (default data/demo)")
    d.add_argument("--seed", type=int, default=0, help="the generator's seed (default 0)")
    d.add_argument("--train-per-group", type=int, default=3000,
                   help="train samples in each of the six groups (default 3000)")
    d.add_argument("--eval-per-group", type=int, default=100,
                   help="held-out samples in each group (default 100)")
    d.add_argument("--tokenizer", default=None, help="default: the bundled demo tokenizer")
    d.add_argument("--seq-len", type=int, default=256, help="context length (default 256)")
    d.add_argument("--workers", type=int, default=None, help="worker processes (default 1)")
    d.add_argument("--no-prepare", action="store_true", help="only write the raw JSONL files")
    d.add_argument("--reuse", action="store_true",
                   help="keep the output when this recipe built it (seed, sizes, tokenizer, declared "
                        "provenance); build it again otherwise")
    d.set_defaults(handler=cmd_demo)

    t = dsub.add_parser("demo-tokenizer", help="retrain the demo tokenizer (deterministic)")
    t.add_argument("--output", "-o", default=None, help="default: data_prep/mimir_data_prep/demo/tokenizer")
    t.add_argument("--seed", type=int, default=0, help="the training seed (default 0)")
    t.set_defaults(handler=cmd_demo_tokenizer)

    v = dsub.add_parser(
        "declare", help="record the provenance of raw data files (a sidecar that prepare and synth read)",
        description="Write FILE.provenance.json beside each file: the provenance `mimir prepare`, "
        "`mimir synth tools` and `mimir synth run` take for data made from it (docs/data-governance.md).")
    v.add_argument("files", nargs="+", help="JSONL or Parquet files")
    add_provenance_flags(v)
    v.set_defaults(handler=cmd_declare)

    g = dsub.add_parser("keygen", help="make an Ed25519 key pair for signing manifests",
                        description="Write KEY (private, mode 0600) and KEY.pub; a mixture's "
                        "data_policy.public_key: KEY.pub then trains only on manifests signed with KEY.")
    g.add_argument("--output", required=True, metavar="KEY", help="the private key file to create")
    g.set_defaults(handler=cmd_keygen)
    s = dsub.add_parser("sign", help="sign prepared datasets' manifests (manifest.sig)")
    s.add_argument("datasets", nargs="+", help="prepared dataset directories")
    s.add_argument("--key", required=True, help="the private key (mimir data keygen)")
    s.set_defaults(handler=cmd_sign)

    k = dsub.add_parser("pack", help="build and cache the packing index ahead of training")
    k.add_argument("--mixture", "-m", required=True, help="mixture YAML")
    k.add_argument("--seq-len", type=int, default=4096, help="context length (default 4096)")
    k.add_argument("--seed", type=int, default=1234,
                   help="the epoch plan's seed: the train config's data.seed (default 1234)")
    k.add_argument("--pack-window", type=int, default=16384,
                   help="samples per best-fit packing window: the train config's data.pack_window "
                   "(default 16384)")
    k.add_argument("--index-dir", default=None,
                   help="where the index is cached (default: _index beside the mixture's first dataset)")
    k.add_argument("--epochs", type=int, default=1, help="epochs to index (default 1)")
    k.add_argument("--workers", type=int, default=None,
                   help="processes packing an epoch's windows (default: the cores; the index is the same)")
    k.set_defaults(handler=cmd_pack)


def cmd_report(args: argparse.Namespace) -> int:
    from mimir_data_prep.mixture_report import report

    print(report(args.mixture, args.top))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from mimir_data_prep.demo_build import build_demo

    build_demo(args.output, seed=args.seed, train_per_group=args.train_per_group,
               eval_per_group=args.eval_per_group, tokenizer=args.tokenizer, seq_len=args.seq_len,
               workers=args.workers, prepare=not args.no_prepare, reuse=args.reuse)
    return 0


def cmd_demo_tokenizer(args: argparse.Namespace) -> int:
    from mimir_data_prep.demo_tokenizer import DEMO_TOKENIZER_DIR, train_demo_tokenizer

    out = train_demo_tokenizer(Path(args.output) if args.output else DEMO_TOKENIZER_DIR, args.seed)
    log.info("demo tokenizer written to %s", out)
    return 0


def cmd_declare(args: argparse.Namespace) -> int:
    from mimir_megatron.data.provenance import write_sidecar
    from mimir_megatron.errors import UserError

    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        raise UserError(f"input file not found: {missing[0]}")
    for path in args.files:
        # The flags again for each file: the provenance id defaults to the file's name.
        provenance = provenance_from_flags(args, default_id=Path(path).name.split(".")[0], output=path)
        if provenance is None:
            raise UserError("mimir data declare needs the provenance flags "
                            "(--source, --license, --basis, --form)")
        print(f"{path}: {write_sidecar(path, provenance)}")
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from mimir_megatron.data.signing import generate_key

    private, public = generate_key(args.output)
    print(f"private key: {private}\npublic key:  {public}")
    return 0


def cmd_sign(args: argparse.Namespace) -> int:
    from mimir_megatron.data.signing import sign_manifest

    for dataset in args.datasets:
        print(f"{dataset}: {sign_manifest(dataset, args.key)}")
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    from mimir_data_prep.pack_index import build_packing_index

    packed = build_packing_index(args.mixture, seq_len=args.seq_len, seed=args.seed,
                                 pack_window=args.pack_window, index_dir=args.index_dir,
                                 epochs=args.epochs, workers=args.workers)
    for epoch in packed.epochs:
        print(f"epoch {epoch.epoch}: {epoch.contexts:,} contexts, padding {100 * epoch.padding:.2f} %")
    print(f"index cached in {packed.index_dir}")
    return 0
