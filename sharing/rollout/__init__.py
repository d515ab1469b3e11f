"""The safe change protocol (orchestration): who holds what, withdraw and confirm, the journaled apply,
what the outcome means, what is advertised, drain mode, and GPU health.

`rollout` orders a whole change: `holding` says who holds which device (over `sharing.kubelet`),
`withdraw` takes devices away and confirms it with the kubelet, `apply` plans and runs the steps under
the journal, `mps` keeps the MPS daemons in step, `verdict` turns the result into the state, the Event
and the retry, and `advertise` offers what the hardware has through the front-end in service
(`frontend`; `switch` moves a node between the device plugins and DRA). `drain` cordons and evicts
when asked; `health` follows the backend's XIDs.
"""

from sharing.rollout.apply import ApplyReport, apply_config
from sharing.rollout.drain import Drainer
from sharing.rollout.health import follow_health
from sharing.rollout.rollout import Rollout
from sharing.rollout.verdict import Retry, Verdict, held_back
from sharing.rollout.withdraw import PodResources

__all__ = [
    "ApplyReport",
    "Drainer",
    "PodResources",
    "Retry",
    "Rollout",
    "Verdict",
    "apply_config",
    "follow_health",
    "held_back",
]
