"""``coordinator dashboard``: a live, read-only web page of a fleet's save state,
and ``/metrics`` for Prometheus.

The server follows the bus (the stream's history, then live events, and the
hosts' presence beats) and folds every event with the monitor's fold, one
session at a time (``_fleet``). Pages get the overview over Server-Sent Events;
``/metrics`` is the same fold in the Prometheus format (``_metrics``). The page
(``static/dashboard.html``, shipped in the package: no CDN, no build) has a URL
per session, ``/sessions/<id>``.

Needs the ``web`` extra: from a checkout of the project, ``pip install '.[web]'``
(the package is on no registry).
"""

from __future__ import annotations

from ._fleet import HEALTH_ORDER, HISTORY, ID_BUDGET, ROW_BUDGET, STALE_AFTER_S, Dashboard, Health
from ._metrics import MAX_SESSIONS, registry
from ._web import LOOPBACK_NAMES, app, follow, listening_socket, serve

__all__ = [
    "HEALTH_ORDER",
    "HISTORY",
    "ID_BUDGET",
    "LOOPBACK_NAMES",
    "MAX_SESSIONS",
    "ROW_BUDGET",
    "STALE_AFTER_S",
    "Dashboard",
    "Health",
    "app",
    "follow",
    "listening_socket",
    "registry",
    "serve",
]
