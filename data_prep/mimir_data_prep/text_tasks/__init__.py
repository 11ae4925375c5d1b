"""Text-to-instruction task families: seeded transforms of raw text into (prompt, completion).

The corrupted, masked, truncated or shuffled text sits in the prompt; the completion is always a
verbatim span of the source, so the model is trained only to reproduce real text.
"""

from .tasks import TASK_FAMILIES, TextSample, make_sample, split_units
from .templates import LANGUAGES

__all__ = ["LANGUAGES", "TASK_FAMILIES", "TextSample", "make_sample", "split_units"]
