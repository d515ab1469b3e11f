"""What the agent keeps on the node's disk (adapter): the journal of hardware steps and its lock, and
the last good config (`last-good.json` beside the journal). Files are written atomically and read
with a size cap; a file that is not what the agent writes is moved aside, never half-trusted.
"""

from sharing.store.journal import DEFAULT_PATH as DEFAULT_JOURNAL
from sharing.store.journal import Journal, JournalCorruptError, JournalError, Unfinished
from sharing.store.memory import LastGood, LastGoodError, Remembered

__all__ = [
    "DEFAULT_JOURNAL",
    "Journal",
    "JournalCorruptError",
    "JournalError",
    "LastGood",
    "LastGoodError",
    "Remembered",
    "Unfinished",
]
