"""Personal-data screen benchmark: precision and recall per kind on a labelled sample, and speed.

    python bench/bench_personal_data.py              # 2,000 documents with and 2,000 without
    python bench/bench_personal_data.py --n 200      # a quick look

The labelled sample is generated here, seeded: sentences in English, Danish, Swedish and German
with one identifier each, drawn from generators that produce *valid* identifiers (e-mail
addresses; phone numbers in the national formats of DK, SE, DE, GB and US, with and without the
country code; IBANs of DK, DE, SE, GB with their check digits; Visa/Mastercard numbers with a Luhn
check digit, grouped and ungrouped; Danish CPR numbers of either century, with the dash, and without
it when the modulus-11 check holds; Swedish personnummer; US SSNs; IPv4 and IPv6 addresses) and,
as the negatives, the same sentences with look-alike numbers (arithmetic, dates, versions, order
numbers, ISBNs, 10-digit date-like numbers without a CPR check digit, digit runs). A document
counts as found for a kind when the screen reports that kind in it; a clean document flagged with
anything is a false positive. Generated identifiers are not real text: recall on real data is
lower where people write identifiers in forms the generators do not (a phone number as one bare
digit run is deliberately not taken for one). Not a test: speed depends on the machine's load.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from collections import Counter


def _luhn_complete(digits: str) -> str:
    from stdnum import luhn

    return digits + luhn.calc_check_digit(digits)


def _cpr(r: random.Random, dash: bool) -> str:
    from stdnum.dk import cpr

    while True:
        day, month, year = r.randint(1, 28), r.randint(1, 12), r.randint(0, 99)
        number = f"{day:02d}{month:02d}{year:02d}{r.randint(0, 9999):04d}"
        if cpr.is_valid(number) and (dash or cpr.checksum(number) == 0):
            return f"{number[:6]}-{number[6:]}" if dash else number


def _iban(r: random.Random) -> str:
    from stdnum import iban

    country, bban = r.choice([("DK", "{14}"), ("DE", "{18}"), ("SE", "{20}"), ("GB", "NWBK{14}")])
    digits = "".join(r.choice("0123456789") for _ in range(int(bban[-3:-1])))
    number = country + "00" + bban[:-4] + digits
    number = number[:2] + iban.calc_check_digits(number) + number[4:]
    return " ".join(number[i:i + 4] for i in range(0, len(number), 4)) if r.random() < 0.5 else number


def _phone(r: random.Random) -> str:
    region = r.choice(["DK", "SE", "DE", "GB", "US"])
    local = {"DK": lambda: f"{r.choice([20, 30, 40, 50, 60, 70])} {r.randint(10, 99)} {r.randint(10, 99)} "
                           f"{r.randint(10, 99)}",
             "SE": lambda: f"070-{r.randint(100, 999)} {r.randint(10, 99)} {r.randint(10, 99)}",
             "DE": lambda: f"030 {r.randint(100000, 999999)}",
             "GB": lambda: f"020 7{r.randint(100, 999)} {r.randint(1000, 9999)}",
             "US": lambda: f"({r.choice([212, 415, 617])}) {r.randint(200, 999)}-{r.randint(1000, 9999)}",
             }[region]()
    if r.random() < 0.5:
        code = {"DK": "+45", "SE": "+46", "DE": "+49", "GB": "+44", "US": "+1"}[region]
        local = code + " " + (local.lstrip("0") if region != "US" else local)
    return local


def _identifier(r: random.Random, kind: str) -> str:
    if kind == "email":
        name = r.choice(["anna", "lars.jensen", "m.berg", "k_schmidt", "ole+news"])
        return f"{name}@{r.choice(['example.dk', 'mail.example.com', 'firma.se', 'uni-example.de'])}"
    if kind == "phone":
        return _phone(r)
    if kind == "iban":
        return _iban(r)
    if kind == "payment_card":
        number = _luhn_complete(r.choice(["4", "51", "52", "55"]) + "".join(r.choice("0123456789")
                                                                        for _ in range(13)))
        number = number[:16].ljust(16, "0")
        number = _luhn_complete(number[:15])
        return " ".join(number[i:i + 4] for i in range(0, 16, 4)) if r.random() < 0.5 else number
    if kind == "national_id":
        which = r.random()
        if which < 0.6:
            return _cpr(r, dash=which < 0.4)
        if which < 0.8:
            from stdnum import luhn
            from stdnum.se import personnummer

            while True:
                base = (f"{r.randint(40, 99):02d}{r.randint(1, 12):02d}{r.randint(1, 28):02d}"
                        f"{r.randint(0, 999):03d}")
                number = f"{base[:6]}-{base[6:]}" + luhn.calc_check_digit(base)
                if personnummer.is_valid(number):
                    return number
        return f"{r.randint(100, 665)}-{r.randint(10, 99)}-{r.randint(1000, 9999)}"
    if r.random() < 0.7:
        return f"{r.randint(1, 223)}.{r.randint(0, 255)}.{r.randint(0, 255)}.{r.randint(1, 254)}"
    return f"2001:db8:{r.randint(0, 65535):x}::{r.randint(1, 65535):x}"


TEMPLATES = ["Please contact {} about the invoice.", "Kontakt venligst {} angående fakturaen.",
             "Vänligen kontakta {} om fakturan.", "Bitte wenden Sie sich an {} wegen der Rechnung.",
             "Oplysningen {} står i journalen.", "The record lists {} as the value."]
LOOK_ALIKES = [lambda r: f"{r.randint(1000, 9999)} + {r.randint(1000, 9999)} = {r.randint(2000, 19998)}",
               lambda r: f"{r.randint(1, 28)}.{r.randint(1, 12)}.{r.randint(1990, 2030)}",
               lambda r: f"version {r.randint(1, 9)}.{r.randint(0, 20)}.{r.randint(0, 99)}",
               lambda r: f"ordre {r.randint(20200101, 20301231)}-{r.randint(0, 9999):04d}",
               lambda r: "ISBN 978-3-16-148410-0",
               lambda r: str(r.randint(10**7, 10**8 - 1)),
               lambda r: _not_cpr(r),
               lambda r: f"{r.randint(0, 99)}-{r.randint(0, 99)}-{r.randint(1000, 9999)}"]


def _not_cpr(r: random.Random) -> str:
    from stdnum.dk import cpr

    while True:
        number = f"{r.randint(1, 28):02d}{r.randint(1, 12):02d}{r.randint(0, 99):02d}{r.randint(0, 9999):04d}"
        if cpr.checksum(number) != 0:
            return number


def main() -> None:
    from mimir_data_prep.personal_data import KINDS, find

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000,
                        help="documents with an identifier, and as many without")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    r = random.Random(args.seed)
    labelled = [(r.choice(TEMPLATES).format(_identifier(r, kind)), kind)
                for kind in (KINDS[i % len(KINDS)] for i in range(args.n))]
    clean = [r.choice(TEMPLATES).format(r.choice(LOOK_ALIKES)(r)) for _ in range(args.n)]
    started = time.perf_counter()
    found = [{k for k, _, _ in find(text)} for text, _ in labelled]
    flagged_kinds = [[(k, text[a:b]) for k, a, b in find(text)] for text in clean]
    flagged = [bool(kinds) for kinds in flagged_kinds]
    seconds = time.perf_counter() - started
    total, hit, predicted, correct = Counter(), Counter(), Counter(), Counter()
    for (_, kind), kinds in zip(labelled, found):
        total[kind] += 1
        hit[kind] += kind in kinds
        for k in kinds:
            predicted[k] += 1
            correct[k] += k == kind
    false_clean = sum(flagged)
    print(f"{2 * args.n} documents in {seconds:.2f} s ({2 * args.n / seconds:,.0f} documents/s)")
    print("| kind | documents | recall | precision |\n| --- | ---: | ---: | ---: |")
    for kind in KINDS:
        precision = correct[kind] / predicted[kind] if predicted[kind] else float("nan")
        print(f"| {kind} | {total[kind]} | {hit[kind] / total[kind]:.3f} | {precision:.3f} |")
    print(f"clean documents flagged: {false_clean} of {args.n} ({100 * false_clean / args.n:.2f} %)")
    shapes = Counter((k, re.sub(r"\d", "9", span)) for kinds in flagged_kinds for k, span in kinds)
    print("flagged clean spans by kind and shape:", dict(shapes.most_common(8)))


if __name__ == "__main__":
    main()
