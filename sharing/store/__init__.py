"""What the agent keeps on the node's disk (adapter): the journal of hardware steps and its lock, the
last good config (`last-good.json` beside the journal), and the DRA front-end's checkpoint of the
claims it prepared. Files are written atomically and read
with a size cap; a file that is not what the agent writes is moved aside, never half-trusted.
"""

from sharing.store.claims import (
    CheckpointCorruptError,
    CheckpointError,
    ClaimCheckpoint,
    OwnedInstance,
    PreparedClaim,
    PreparedDevice,
    PreparedPod,
)
from sharing.store.journal import DEFAULT_PATH as DEFAULT_JOURNAL
from sharing.store.journal import Journal, JournalCorruptError, JournalError, JournalLockedError, Unfinished
from sharing.store.memory import LastGood, LastGoodError, Remembered

__all__ = [
    "DEFAULT_JOURNAL",
    "CheckpointCorruptError",
    "CheckpointError",
    "ClaimCheckpoint",
    "Journal",
    "JournalCorruptError",
    "JournalError",
    "JournalLockedError",
    "LastGood",
    "LastGoodError",
    "OwnedInstance",
    "PreparedClaim",
    "PreparedDevice",
    "PreparedPod",
    "Remembered",
    "Unfinished",
]
