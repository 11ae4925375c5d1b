"""Personal data screened in `mimir prepare` (mimir_data_prep.personal_data): each kind planted in
several languages is found, clean text with look-alike numbers is not, the default rejects
documents with direct identifiers without copying them into rejects.jsonl, redact and report do
what they say, and the counts reach the manifest and the training-data summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mimir_data_prep.personal_data import find
from mimir_megatron.cli import main
from mimir_megatron.data.manifest import Manifest

TOK = str(Path(__file__).resolve().parents[2] / "data_prep" / "mimir_data_prep" / "demo" / "tokenizer")

PLANTED = [  # (text, kind, the span)
    ("Skriv til anna.hansen@example.dk hvis du har spørgsmål.", "email", "anna.hansen@example.dk"),
    ("Ring til mig på +45 32 12 34 56 i morgen.", "phone", "+45 32 12 34 56"),
    ("Mit telefonnummer er 20 30 40 50.", "phone", "20 30 40 50"),
    ("Call the office at (415) 555-2671 before noon.", "phone", "(415) 555-2671"),
    ("Ruf mich unter +49 30 901820 an.", "phone", "+49 30 901820"),
    ("Overfør beløbet til DK50 0040 0440 1162 43.", "iban", "DK50 0040 0440 1162 43"),
    ("Bitte auf DE89 3704 0044 0532 0130 00 überweisen.", "iban", "DE89 3704 0044 0532 0130 00"),
    ("The card number is 4111 1111 1111 1111, expiry 12/29.", "payment_card", "4111 1111 1111 1111"),
    ("Hans CPR-nummer er 070761-4285.", "national_id", "070761-4285"),
    ("cpr 0707614285 står på sygesikringskortet", "national_id", "0707614285"),
    ("Mitt personnummer är 811228-9874.", "national_id", "811228-9874"),
    ("Fødselsnummeret mitt er 15108695088.", "national_id", "15108695088"),
    ("Her SSN is 536-90-4399.", "national_id", "536-90-4399"),
    ("Login from 192.168.1.20 failed.", "ip_address", "192.168.1.20"),
    ("Der Server 2001:db8:85a3::8a2e:370:7334 antwortet nicht.", "ip_address", None),
]
# Written as people write them, missed before (issue 51): each is found, the span whole.
PLANTED_HARDER = [
    ("Hans CPR er 070761 4012.", "national_id", "070761 4012"),  # a space; no modulus 11: a label
    ("Pt. 070761 4285 indlagt på afd. B.", "national_id", "070761 4285"),  # a space; modulus 11
    ("CPR-nr. 0707614012", "national_id", "0707614012"),  # issued since 2007: no modulus 11
    ("Barnets personnr.: 2303854321", "national_id", "2303854321"),
    ("Fødselsnummer 151086 95088", "national_id", "151086 95088"),  # Norwegian, with a space
    ("overfør til dk50 0040 0440 1162 43 i dag", "iban", "dk50 0040 0440 1162 43"),  # lower case
    ("refund to de89370400440532013000 thanks", "iban", "de89370400440532013000"),
    ("Ring på 40751186 hvis du bliver forsinket.", "phone", "40751186"),  # a bare run after a label
    ("Call me on 69977760, it is my private number.", "phone", "69977760"),
    ("The user's home router answers on 192.168.49.201.", "ip_address", "192.168.49.201"),  # at a full stop
    ("Kontaktperson: Søren, sk@tømrerfirma.dk", "email", "sk@tømrerfirma.dk"),  # an IDN domain
]
CLEAN = [  # look-alike numbers that are no personal data
    "1234 + 5678 = 6912", "Regn 12345678 gange 9876543210 ud.", "The year 2026 had 365 days.",
    "Python 3.12.1 and version 1.2.3 are installed.", "ISBN 978-3-16-148410-0", "Ordre 20261203-0001 er sendt.",
    "pi is 3.14159 and e is 2.71828", "Resultatet blev 12-34-5678 i kampen.", "Kontonummer 1234",
    "send it to the team @ the office", "4111 1111 1111 1112 fails the check digit",
    "Nej: 320199-1234 er ikke en dato.", "Sagsnummer 0101901235 (a date, but no CPR check digit)", "Kl. 10:30:45 gik toget.",
]
# Look-alikes that were flagged before (issue 51): none is personal data.
CLEAN_HARDER = [
    "Hansen, Dansk grammatik, ISBN 87-8669-044-2, s. 112.", "Læs kapitel 4 i grundbogen (87-8669-044-2).",  # ISBN-10
    "The sets finished 28-26 28-24, a close match throughout.", "Resultat: 21-17 21-19 i første runde.",  # scores
    "Faktura fra Tømrer Hansen ApS, CVR-nr. 25 31 37 63.", "Firmaet med CVR 6245 5136 blev opløst.",  # CVR
    "The meeting point is at 55.676098, 12.568337 in Copenhagen.",  # coordinates
    "Upgrade the agent to 2.4.1.0 before Friday.", "Changelog for v3.1.4.2: fixed the login loop.",  # versions
    "The schema went from 1.0.0.0 to 1.1.0.0.", "Netmasken er 255.255.255.0.", "The range 192.168.0.0/16 is private.",
    "Subtract: 160973-8097 = 152876.", "The difference is 240588-1215, which gives 239373.",  # arithmetic
    "Perioden 2019-2023 viste en stigning.", "Ring-tiderne var 08.00-09.30 og 13.00-14.30.",  # ranges
    "Published 2024.03.12.", "Invoice 2023-004512 is overdue.", "Policy number 44 128 903 renews in May.",
    "Clone it with git@github.com:acme/tools.git.",  # an SSH remote, not an address
    "Sagen vedrører 1609738097, men det er et løbenummer.",  # ten digits, a date, no check digit, no label
]


@pytest.mark.parametrize("text, kind, span", PLANTED + PLANTED_HARDER)
def test_each_kind_is_found(text, kind, span):
    found = find(text)
    assert [k for k, _, _ in found] == [kind], found
    if span is not None:
        assert text[found[0][1]:found[0][2]] == span


@pytest.mark.parametrize("text", CLEAN + CLEAN_HARDER)
def test_clean_text_with_look_alike_numbers_is_not_flagged(text):
    assert find(text) == []


def _prepare(tmp_path: Path, name: str, *flags: str):
    raw = tmp_path / f"{name}.jsonl"
    lines = [{"prompt": "Who do I contact?", "completion": PLANTED[0][0]},  # email: direct
             {"prompt": "Hvad er mit nummer?", "completion": PLANTED[8][0]},  # CPR: direct
             {"prompt": "Which host?", "completion": PLANTED[13][0]},  # IP: indirect, kept
             {"prompt": "Add them.", "completion": CLEAN[0]},
             {"prompt": "Say hi.", "completion": "Hi there, nice to meet you."}]
    raw.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    out = tmp_path / name
    assert main(["prepare", "-i", str(raw), "-t", TOK, "-o", str(out), "--seq-len", "64", "--workers", "1",
                 "--no-progress", *flags]) == 0
    return Manifest.read(out)


def test_the_default_rejects_direct_identifiers_and_counts_every_kind(tmp_path):
    manifest = _prepare(tmp_path, "default")
    assert manifest.personal_data.to_dict() == {"policy": "reject", "documents_rejected": 2,
                                                "found": {"email": 1, "ip_address": 1, "national_id": 1}}
    assert manifest.documents == 3 and manifest.rejects["personal_data"] == 2
    rejects = (tmp_path / "default" / "rejects.jsonl").read_text()
    assert "direct identifiers found: 1 email" in rejects and "anna.hansen" not in rejects and "070761" not in rejects


def test_redact_and_report(tmp_path):
    from mimir_megatron.data.prepared import PreparedDataset

    redacted = _prepare(tmp_path, "redacted", "--personal-data", "redact")
    assert redacted.documents == 5 and redacted.personal_data.documents_rejected == 0
    from mimir_megatron.chat import load_tokenizer

    tokenizer = load_tokenizer(TOK)
    texts = []
    ds = PreparedDataset(tmp_path / "redacted")
    for i in range(ds.num_documents):
        texts.append(tokenizer.decode(ds.document(i)[1].tolist()))
    joined = "\n".join(texts)
    assert "[EMAIL]" in joined and "[NATIONAL_ID]" in joined and "[IP_ADDRESS]" in joined
    assert "anna.hansen" not in joined and "070761" not in joined
    reported = _prepare(tmp_path, "reported", "--personal-data", "report")
    assert reported.documents == 5 and reported.personal_data.found["email"] == 1


def test_the_counts_reach_the_summary(tmp_path):
    from mimir_megatron.checkpoint import DatasetLineage, TrainerState
    from mimir_megatron.release.summary import summary_markdown, training_data_summary

    _prepare(tmp_path, "default", "--source", "s", "--license", "MIT", "--basis", "open-licence", "--form",
             "reformatted")
    record = json.loads((tmp_path / "default" / "manifest.json").read_text())["provenance"]
    state = TrainerState(step=1, lineage=(DatasetLineage("default", str(tmp_path / "default"), "c", "en", "C",
                                                         record, record["digest"], documents=3, tokens=30),))
    markdown = summary_markdown(training_data_summary(state, model_name="m"))
    assert "personal data (reject policy): 1 email, 1 ip_address, 1 national_id; 2 documents rejected for it" \
        in markdown
    assert "1 of 1 datasets' manifests read at export: 1 screened for personal data" in markdown


def test_the_prepare_yaml_sets_the_policy_per_file_and_dataset_and_the_flag_wins(tmp_path):
    from mimir_data_prep.prepare_config import load_prepare_config

    from mimir_megatron.errors import ConfigError

    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps({"prompt": "Mail?", "completion": PLANTED[0][0]}) + "\n"
                   + json.dumps({"prompt": "Hi.", "completion": "Hello there, friend."}) + "\n")
    config = tmp_path / "prep.yaml"
    config.write_text(f"tokenizer: {TOK}\nseq_len: 64\npersonal_data: report\ndatasets:\n"
                      f"  - {{name: a, input: [{raw}], output: out/a}}\n"
                      f"  - {{name: b, input: [{raw}], output: out/b, personal_data: reject}}\n")
    assert main(["prepare", "--config", str(config), "--workers", "1", "--no-progress"]) == 0
    policies = {n: json.loads((tmp_path / "out" / n / "manifest.json").read_text())["personal_data"]
                for n in "ab"}
    assert (policies["a"]["policy"], policies["a"]["documents_rejected"]) == ("report", 0)
    assert (policies["b"]["policy"], policies["b"]["documents_rejected"]) == ("reject", 1)
    assert main(["prepare", "--config", str(config), "--workers", "1", "--no-progress",
                 "--personal-data", "redact"]) == 0
    assert json.loads((tmp_path / "out" / "b" / "manifest.json").read_text())["personal_data"]["policy"] == "redact"
    config.write_text(config.read_text().replace("personal_data: report", "personal_data: drop"))
    with pytest.raises(ConfigError, match=r"personal_data: one of \('reject', 'redact', 'report'\), got 'drop'"):
        load_prepare_config(config)


def test_the_digit_prefilter_agrees_with_the_regex_on_every_code_point():
    """find's quick digit test (a byte deletion where the text is Latin-1) says what ``\\d``
    says for every code point alone and beside Latin-1 and wider text: a digit it missed would skip
    the IBAN, card, national id, IPv4 and phone patterns."""
    import re

    from mimir_data_prep.personal_data import _has_digit

    digit = re.compile(r"\d")
    for code in range(0x110000):
        texts = [chr(code)]
        if code < 0x100 or chr(code).isdecimal():
            texts += [f"æ{chr(code)}ø", f"日{chr(code)}", f"a{chr(code)}😀"]
        for text in texts:
            assert _has_digit(text) == (digit.search(text) is not None), hex(code)


def test_reject_and_report_count_what_redact_counts():
    """Reject and report only visit the strings (nothing is rebuilt): the same counts per kind,
    in the same order, as redact's walk over nested messages and tools, and the value unchanged."""
    from mimir_data_prep.personal_data import Screen

    value = [{"role": "user", "content": text, "n": 3, "none": None,
              "tool_calls": [{"function": {"arguments": {"note": text, "list": [text, 7]}}}]}
             for text, _, _ in PLANTED] + ["fe80::1 og anna@example.dk", ["10.0.0.1", 5]]
    redacted, want = Screen("redact").screen(value)
    assert redacted != value and sum(want.values()) >= 3 * len(PLANTED)
    for policy in ("reject", "report"):
        kept, counts = Screen(policy).screen(value)
        assert kept is value
        assert list(counts.items()) == list(want.items()), policy
