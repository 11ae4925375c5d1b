"""Worker: `mimir train` whose checkpoint writes wait while a HOLD file exists.

Usage: held_save_worker.py HOLD MARKER mimir-train-args...
While HOLD exists, every dist_checkpointing data write touches MARKER and waits until HOLD is
removed (at most 5 minutes): a test can send signals *during* a save. With
``checkpoint.async_save=true`` the write runs in megatron's forked writer, which inherits this.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
from checkpoint_faults import patch_data_writes  # noqa: E402

from mimir_megatron.cli import main  # noqa: E402


def hold_while(stream, hold: Path, marker: Path) -> None:
    if not hold.exists():
        return
    marker.touch()
    deadline = time.monotonic() + 300
    while hold.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":  # checkpoint writers spawn processes that re-import this module
    hold, marker, *argv = sys.argv[1:]
    patch_data_writes(None, lambda stream: hold_while(stream, Path(hold), Path(marker)))
    sys.exit(main(argv))
