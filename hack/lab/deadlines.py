"""One scale factor for every deadline of the tests and the lab: `SHARING_TEST_TIMEOUT_SCALE`.

A wait waits for its condition; its deadline only says when to give up and report what it waited
for. A deadline that holds on an idle machine can be too short on a loaded one (`hack/test.sh
--under-load` sets the factor to 3): every deadline is written for an idle machine and stretched
here, never tuned one by one.
"""

from __future__ import annotations

import os

ENV = "SHARING_TEST_TIMEOUT_SCALE"


def scale() -> float:
    """The factor (1 unless the environment says otherwise; never below 1)."""
    raw = os.environ.get(ENV, "")
    try:
        return max(1.0, float(raw)) if raw else 1.0
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: a number is needed (1 = an idle machine)") from None


def scaled(seconds: float) -> float:
    """`seconds` on an idle machine, stretched by the factor."""
    return seconds * scale()
