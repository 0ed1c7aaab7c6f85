"""One process of a job that only exchanges values through `distributed.HostGroup`, a round every
0.1 s, printing "round N" after each (test helper).

  python tests/distributed/exchange_worker.py --coordinator=localhost:PORT --num_processes=2 \
      --process_id=I [--heartbeat_timeout_s=S] [--exchange_timeout_s=S] [--silent_from=N]

With `--silent_from` N, process 1 stops exchanging at round N (it sleeps, alive: a stuck host).
"""
from __future__ import annotations

import argparse
import time

from mars_jax import distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--process_id", type=int, required=True)
    parser.add_argument("--heartbeat_timeout_s", type=int, default=60)
    parser.add_argument("--exchange_timeout_s", type=float, default=600)
    parser.add_argument("--silent_from", type=int, default=None)
    args = parser.parse_args()
    distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                           heartbeat_timeout_s=args.heartbeat_timeout_s)
    hosts = distributed.HostGroup("stream", args.exchange_timeout_s, log_every_s=1.0)
    for round_ in range(100_000):
        if args.process_id == 1 and round_ == args.silent_from:
            time.sleep(3600)
        assert hosts.gather(round_) == [round_] * args.num_processes
        print(f"round {round_}", flush=True)
        time.sleep(0.1)


if __name__ == "__main__":
    main()
