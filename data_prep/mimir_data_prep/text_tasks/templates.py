"""Instruction templates per task family and language; ``{text}`` is the transformed passage."""

from __future__ import annotations

LANGUAGES = ("en", "da")

TEMPLATES: dict[str, dict[str, tuple[str, ...]]] = {
    "repair": {
        "en": (
            "Fix the errors in this text and write it out correctly:\n{text}",
            "The following text has been corrupted. Restore the original:\n{text}",
        ),
        "da": (
            "Ret fejlene i denne tekst og skriv den korrekt:\n{text}",
            "Den følgende tekst er blevet forvansket. Gendan originalen:\n{text}",
        ),
    },
    "spans": {
        "en": (
            "Fill in the masked parts ({markers}) and write the complete text:\n{text}",
            "Some words are hidden behind {markers}. Write the full original text:\n{text}",
        ),
        "da": (
            "Udfyld de skjulte dele ({markers}) og skriv hele teksten:\n{text}",
            "Nogle ord er skjult bag {markers}. Skriv hele den oprindelige tekst:\n{text}",
        ),
    },
    "continue": {
        "en": ("Continue the text:\n{text}", "Write what comes next:\n{text}"),
        "da": ("Fortsæt teksten:\n{text}", "Skriv hvad der kommer bagefter:\n{text}"),
    },
    "reorder": {
        "en": (
            "Put these parts back in their original order and write the text:\n{text}",
            "The sentences below are shuffled. Write them in the right order:\n{text}",
        ),
        "da": (
            "Sæt disse dele tilbage i den oprindelige rækkefølge og skriv teksten:\n{text}",
            "Sætningerne nedenfor er blandet. Skriv dem i den rigtige rækkefølge:\n{text}",
        ),
    },
}

MASK_MARKER = "<mask_{}>"
