"""Deprecated: the decode-loan roster moved to ``rollmesh.inference.decode_loans`` (plain logic,
used by the rollout workers and the Serve app, so the Serve app need not import the actors).
Importing a name from here warns; this module is removed in the next release.
"""

from rollmesh.moved_names import forward_moved_names

__getattr__ = forward_moved_names(__name__, {"DecodeLoanRoster": "rollmesh.inference.decode_loans"})
