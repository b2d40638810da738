"""The tensor-parallel ranks' inboxes as kernels see them: the mirror of kernels_cu/peers.cuh,
given to the collectives' kernels and to the producers that push their output into an all-reduce
themselves (collective.Collective.sender)."""

from __future__ import annotations

import ctypes

MAX_RANKS = 8
EMPTY = 0x80008000  # an inbox word not yet written


class Peers(ctypes.Structure):
    """peers.cuh's Peers; zeroed (world 0): nowhere to push."""

    _fields_ = [
        ("inbox", ctypes.c_void_p * MAX_RANKS),
        ("epoch", ctypes.c_void_p),
        ("slot_bytes", ctypes.c_int64),
        ("rank", ctypes.c_int),
        ("world", ctypes.c_int),
    ]
