"""Commit checkpoints in a loop, printing each id once commit() has returned.

    python tests/store_worker.py STORE FIRST_INDEX

Used by test_store_kill.py, which kills this process with SIGKILL at random.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from storekit import checkpoint

from coordinator.store import SyncStore


def main(store_path: str, first: int) -> None:
    with SyncStore(store_path) as store:
        print("open", flush=True)
        for index in itertools.count(first):
            manifest, payloads = checkpoint(index, size=50_000 + index % 7 * 10_000)
            store.commit(manifest, payloads)
            print(manifest.checkpoint_id, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
