"""What a heal over ``PGTransport`` sends and takes, ours against FSDP2 (2 replica groups x 2
gloo ranks, the heal driven directly as in :mod:`.heal`; torch's AdamW states included, then
our AdamW8bit's and Muon's).

    python -m tests.fault_tolerance.measure_heal [decoder4|bench ...]
"""

from __future__ import annotations

import sys

from tests.fault_tolerance.heal import heal_over_pg_transport
from tests.support.distributed import DistributedRunner

CASES = [
    ("torch", "torchft", "adamw"),
    ("vescale", "torchft", "adamw"),
    ("torch", "vescale", "adamw"),
    ("vescale", "vescale", "adamw"),
    ("torch", "flat", "adamw"),
    ("vescale", "flat", "adamw"),
    # Our optimizers' states (our engine only: AdamW8bit wants whole tiles per rank).
    ("vescale", "torchft", "adamw8bit"),
    ("vescale", "flat", "adamw8bit"),
    ("vescale", "torchft", "muon"),
    ("vescale", "flat", "muon"),
]


def main(models: list[str]) -> None:
    runner = DistributedRunner()
    try:
        for model in models:
            layers = 4 if model == "decoder4" else model
            for engine, transport, optim in CASES:
                results = runner(
                    heal_over_pg_transport, 4, engine, transport, layers, states=False, optim=optim, timeout=600
                )
                sent = sum(r["bytes"] for r in results)
                messages = sum(r["messages"] for r in results)
                seconds = max(r["seconds"] for r in results if r["replica"] == 1)
                print(
                    f"{model:9} {engine:8} {optim:9} via {transport:8} transport: {sent:>11,} B  {messages:4} sends  "
                    f"{seconds:.3f} s"
                )
    finally:
        runner.close()


if __name__ == "__main__":
    main(sys.argv[1:] or ["decoder4", "bench"])
