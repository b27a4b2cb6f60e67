"""Verification and recovery (``verify``): finds what the joiners' registry says was joined but no output holds, and
joins it again.

May import: ``photon.joiner``, ``photon.registry``, ``photon.logs`` and the foundation."""
