"""Build the fused CPU kernels quantkit ships (fusion.SHIPPED): `make kernels`, or
`python -m quantkit.backends.gguf.ship_kernels`.

A kernel depends on the fused functions' source and on torch, so the set is rebuilt after either changes
(tests/test_gguf_fused.py fails while it is stale); it covers every fused type, weighted and not, which is
what a run's probe (writer.py) may ask for.  Building takes a few minutes on 2 cores, once per change.
"""
from __future__ import annotations

from . import fusion
from .kernel_samples import EVERY_KIND, encode_samples


def main() -> None:
    built, wanted = fusion.ship(lambda: encode_samples(EVERY_KIND))
    print(f"{fusion.shipped_dir()}: {built} kernels built, {wanted - built} failed, "
          f"{len(list(fusion.shipped_dir().glob('*.pt2')))} shipped")
    if built < wanted:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
