"""Worker: `mimir train` whose checkpoint write of one step blocks forever (to kill it mid-write).

Usage: blocking_write_worker.py MARKER BLOCKED_NAME mimir-train-args...
Every dist_checkpointing data file written under a directory named BLOCKED_NAME (e.g.
``step_0000006.tmp``) touches MARKER and then sleeps: the write never finishes. With
``checkpoint.async_save=true`` the write runs in megatron's forked writer process, which inherits
this patch.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
from checkpoint_faults import patch_data_writes  # noqa: E402

from mimir_megatron.cli import main  # noqa: E402


def block_forever(stream, marker: Path) -> None:
    import time

    marker.write_text(str(stream.name))
    while True:
        time.sleep(1)


if __name__ == "__main__":
    marker, blocked, *argv = sys.argv[1:]
    patch_data_writes(blocked, lambda stream: block_forever(stream, Path(marker)))
    sys.exit(main(argv))
