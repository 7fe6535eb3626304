"""A stand-in service for the launcher's tests: generation 0 hangs without listening (as a hivemind
server start can); later generations record multiaddrs at once. Runs until SIGTERM."""

import argparse
import json
import signal
import time

from ddlscope.store.db import ResultsStore

p = argparse.ArgumentParser()
for flag in ("--db", "--run-id", "--cores"):
    p.add_argument(flag)
p.add_argument("--index", type=int)
p.add_argument("--generation", type=int)
p.add_argument("--initial-peers", nargs="*", default=[])
p.add_argument("--die-with-parent", action="store_true")
args = p.parse_args()
signal.signal(signal.SIGTERM, lambda *_: exit(0))
if args.generation > 0:
    with ResultsStore(args.db) as store:
        store.upsert_service(args.run_id, "fake", args.index, args.generation, status="serving",
                             maddrs=json.dumps([f"/ip4/127.0.0.1/tcp/{4000 + args.generation}"]))
while True:
    time.sleep(0.1)
