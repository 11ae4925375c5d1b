"""Memorisation audits: an exact-match index over the training data, and the two protocols.

``mimir audit index`` builds the index, ``mimir audit prefix`` runs the prefix attack (longest
verbatim span of greedy outputs in any training document) and ``mimir audit continuation`` the
64+64 exact-continuation protocol. Imports the model, data and inference halves, never the trainer.
"""

from .index import AuditIndex, Hit, build_index
from .sources import AuditSource, resolve_sources

__all__ = ["AuditIndex", "AuditSource", "Hit", "build_index", "resolve_sources"]
