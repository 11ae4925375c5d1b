"""HumanEval's runner: a candidate program and its test in a fresh, isolated interpreter.

Integration tier: each check starts a Python process. The limits of the passing programs are
hang detectors (generous, scaled by ``MIMIR_TEST_TIMEOUT_SCALE``): on a loaded machine an
interpreter's start-up alone can take seconds. The endless loop's 2 s is the runner's own limit
under test.
"""

from __future__ import annotations

from polling import hang_limit

from mimir_megatron.evaluation.code_exec import passes, program_from_reply

TEST = "def check(candidate):\n    assert candidate(1) == 3\n"
PROMPT = "def add_2(x):\n    \"\"\"x + 2\"\"\"\n"


def test_humaneval_runner():
    limit = hang_limit(120)
    assert passes(program_from_reply("```python\ndef add_2(x):\n    return x + 2\n```", PROMPT), TEST, "add_2",
                  timeout_s=limit)
    assert passes(program_from_reply("    return x + 2\n", PROMPT), TEST, "add_2", timeout_s=limit)
    assert not passes(program_from_reply("    return x + 3\n", PROMPT), TEST, "add_2", timeout_s=limit)
    assert not passes(PROMPT + "    while True:\n        pass\n", TEST, "add_2", timeout_s=2)
    blocked = ("def add_2(x):\n    import socket\n    try:\n        socket.create_connection(('127.0.0.1', 9))\n"
               "    except OSError as e:\n        return x + 2 if 'disabled' in str(e) else 0\n    return 0\n")
    assert passes(blocked, TEST, "add_2", timeout_s=limit)
