"""Memorisation audits: an exact-match index over the training data, and the two protocols.

``mimir audit index`` builds the index, ``mimir audit prefix`` runs the prefix attack (longest
verbatim span of greedy outputs in any training document) and ``mimir audit continuation`` the
64+64 exact-continuation protocol; ``mimir audit contamination`` checks the evaluation suites'
items against the same index and writes the denylist `mimir prepare` applies. Imports the model,
data, inference and evaluation halves, never the trainer.
"""

from mimir_megatron.lazy import lazy_exports

# Imported on first use: the CLI imports this package to register its commands.
__getattr__ = lazy_exports(__name__, {
    "AuditIndex": ".index_query", "Hit": ".index_query", "build_index": ".index_build",
    "AuditSource": ".sources", "resolve_sources": ".sources",
})
__all__ = ["AuditIndex", "AuditSource", "Hit", "build_index", "resolve_sources"]
