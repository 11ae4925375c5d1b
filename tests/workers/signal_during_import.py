"""Worker: `mimir ARGS...` that sends itself SIGTERM the moment anything starts importing torch.

So the signal lands while the CLI is still importing, deterministically: with the default
handler still in place the process dies of it (exit -15).
"""

import importlib.abc
import os
import signal
import sys


class SignalOnTorchImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGTERM)
        return None  # the import itself proceeds as usual


if __name__ == "__main__":  # checkpoint writers spawn processes that re-import this module
    sys.meta_path.insert(0, SignalOnTorchImport())
    from mimir_megatron.cli import main

    sys.exit(main(sys.argv[1:]))
