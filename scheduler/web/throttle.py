"""How many wrong tokens a client may send: a few at once, then one every few seconds.

Each client has a bucket of `BURST` guesses that refills one every `REFILL_S`
seconds; a client whose bucket is empty is refused (429) whatever it sends,
the right token too, until it regains one. A client is its address; an IPv6
client by its /64, which one host usually holds whole. The table is bounded:
beyond `MOST` clients, the one seen longest ago is forgotten (its bucket
would have refilled the soonest).
"""

from __future__ import annotations

import ipaddress
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

BURST = 10  # wrong tokens a client may send in a row
REFILL_S = 6.0  # then one more every this many seconds (ten a minute)
MOST = 4096  # clients remembered at once


class Throttle:
    def __init__(
        self,
        burst: int = BURST,
        refill_s: float = REFILL_S,
        most: int = MOST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst = burst
        self.refill_s = refill_s
        self.most = most
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # guesses left, at
        self._lock = threading.Lock()  # requests are answered on threads of their own

    def __len__(self) -> int:
        return len(self._buckets)

    def _left(self, key: str) -> float:
        with self._lock:
            left, at = self._buckets.get(key, (float(self.burst), self.clock()))
        regained = (self.clock() - at) / self.refill_s
        return min(float(self.burst), left + max(0.0, regained))

    def allows(self, client: str) -> bool:
        """Whether the client may try a token now."""
        return self._left(client_key(client)) >= 1.0

    def retry_after(self, client: str) -> int:
        """Whole seconds until the client regains a guess."""
        missing = 1.0 - self._left(client_key(client))
        return max(1, math.ceil(missing * self.refill_s))

    def failed(self, client: str) -> int:
        """Count a wrong token; returns the guesses the client has left."""
        key = client_key(client)
        left = max(0.0, self._left(key) - 1.0)
        with self._lock:
            self._buckets[key] = (left, self.clock())
            self._buckets.move_to_end(key)
            while len(self._buckets) > self.most:
                self._buckets.popitem(last=False)
        return int(left)


def client_key(address: str) -> str:
    """An IPv4 address as it is; an IPv6 one by its /64; anything else as given."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address[:100]
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, 64), strict=False))
    return str(parsed)
