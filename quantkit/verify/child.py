"""One runtime's side of `quantkit verify`, in its own process (so its peak memory is its own, and a runtime
that crashes takes only this process down): load the artifact the first way that works (loads and runs a forward), in
the order a user would try them; time the load, the prompt's logits and greedy decoding; save the logits for the parent.

    python -m quantkit.verify.child REQUEST.json      (writes REQUEST.json's "out" .pt; prints RESULT {...})
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def main(request_path: str) -> None:
    from ..backends import registered_backends
    req = json.loads(Path(request_path).read_text())
    backend = registered_backends()[req["format"]]
    ids, gen = req["ids"], req["generate"]
    failures = []
    for how, load in backend.runtime_loaders(Path(req["artifact"]), req["runtime"], len(ids) + gen):
        t0 = time.perf_counter()
        try:
            session = load()
        except Exception as e:     # this way does not load: say so, try the next documented one
            failures.append({"how": how, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
            continue
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            logits = session.prompt_logits(ids)
        except Exception as e:     # loaded, but its kernels refuse the shapes at the first forward: this way fails
            failures.append({"how": how, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
            del session
            continue
        prompt_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        made = session.decode(gen)
        decode_s = time.perf_counter() - t0
        torch.save(logits, req["out"])
        result = {"loaded": True, "how": how, "dtype": session.dtype, "failed_ways": failures,
                  "load_s": load_s, "prompt_tokens_per_s": len(ids) / prompt_s, "decode_tokens_per_s": gen / decode_s,
                  "generated": made}
        break
    else:
        result = {"loaded": False, "failed_ways": failures}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
