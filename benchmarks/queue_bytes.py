r"""Checkpoint bytes of the rollout queues per pending token: as JSON (every record's prompt ids,
response ids, log-probabilities and texts in the meta, the format before `rl/queue_arrays.py`)
vs as arrays (token ids int32, log-probabilities float32, each distinct prompt once, the rest of
the queue in the meta).

  python benchmarks/queue_bytes.py --workdir=/tmp/h2q_stream

Reads every checkpoint of a training run's workdir (one process), rebuilds the JSON format from
it, and prints per checkpoint: the queue's records, its pending tokens (each record's prompt and
response tokens, as the JSON format stores them), the JSON format's bytes, the array format's
meta bytes and array bytes (raw, and the `arrays` item on disk, which orbax compresses), and
both formats' bytes per pending token.
"""
import argparse
import json
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

from mars_jax import distributed
from mars_jax.data.tokenizer import tiny_tokenizer
from mars_jax.rl import queue_arrays


def _records(value):
    if isinstance(value, list):
        for v in value:
            yield from _records(v)
    elif isinstance(value, dict):
        if queue_arrays.RECORD_KEYS <= value.keys():
            yield value
        else:
            for v in value.values():
                yield from _records(v)


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(step_dir: Path, decode) -> dict:
    manager = ocp.CheckpointManager(step_dir.parent)
    step = int(step_dir.name)
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    host = distributed.local_process_meta(meta)
    key = "stream" if "stream" in host else "rollouts"
    target = distributed.host_arrays_target(host["queue"])
    arrays = manager.restore(step, args=ocp.args.Composite(
        arrays=ocp.args.StandardRestore({"queue": target}))).arrays
    manager.close()
    blocks = distributed.unpack_host_arrays(host["queue"], arrays["queue"])
    flat = queue_arrays.from_host_blocks(blocks)
    state = queue_arrays.unpack(host[key], flat, decode)
    records = list(_records(state))
    tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in records)
    response = sum(len(r["response_ids"]) for r in records)
    json_bytes = len(json.dumps(state).encode())
    size = lambda field: sum(len(json.dumps(r[field]).encode()) for r in records)
    meta_bytes = len(json.dumps({key: host[key], "queue": host["queue"]}).encode())
    raw = sum(x.nbytes for x in flat.values())
    return dict(step=step, records=len(records), tokens=tokens, response_tokens=response,
                json_bytes=json_bytes, meta_bytes=meta_bytes, array_bytes=raw,
                array_disk_bytes=_disk_bytes(step_dir / "arrays"),
                json_response=(size("response_ids") + size("logprobs")) / max(response, 1),
                json_prompt=size("prompt_ids") / max(tokens - response, 1),
                array_prompt=flat["prompt_ids"].nbytes / max(tokens - response, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    tokenizer = tiny_tokenizer()
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    steps = sorted((p for p in (Path(args.workdir) / "checkpoints").iterdir() if p.name.isdigit()),
                   key=lambda p: int(p.name))
    print("step  records  pending tokens (response)  JSON B  B/token  |  meta B + arrays B "
          "(on disk)  B/token raw (on disk)")
    for step_dir in steps:
        m = measure(step_dir, decode)
        per = lambda b: b / max(m["tokens"], 1)
        print(f"{m['step']:>4}  {m['records']:>7}  {m['tokens']:>8} ({m['response_tokens']:>6})  "
              f"{m['json_bytes']:>9}  {per(m['json_bytes']):7.1f}  |  {m['meta_bytes']:>7} + "
              f"{m['array_bytes']:>7} ({m['array_disk_bytes']:>7})  "
              f"{per(m['meta_bytes'] + m['array_bytes']):5.1f} "
              f"({per(m['meta_bytes'] + m['array_disk_bytes']):5.1f})")
        print(f"      a response token (id + log-probability): {m['json_response']:.1f} B as "
              f"JSON, 8 B as arrays; a prompt token: {m['json_prompt']:.1f} B as JSON, "
              f"{m['array_prompt']:.2f} B as arrays (each distinct prompt once)")
    print(f"tokenizer: tiny; {np.dtype(np.int32).itemsize} B per token id, "
          f"{np.dtype(np.float32).itemsize} B per log-probability in the arrays")


if __name__ == "__main__":
    main()
