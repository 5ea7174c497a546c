"""One of two jobs saving to the same checkpoint path in a loop (see ``test_state_dict.py``).

``python tests/concurrent_save.py PATH WRITER N OUT [hf]``: N times, fill a small model with values
that name this writer and iteration, ``save_checkpoint(PATH, overwrite=True)`` (with ``hf``:
``save_pretrained(model, PATH, overwrite=True)``), and record how the call ended: ``"ok"``, or the
``CheckpointError`` (``hf``: the ``FileExistsError`` naming the path) it raised. Anything else (a raw ``OSError``,
``FileExistsError``) is recorded by type and makes the test fail. One process, no process group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from zeta_fsdp.state_dict import CheckpointError, save_checkpoint


def main(path: Path, writer: int, n: int, out: Path, hf: bool = False) -> None:
    from zeta_fsdp.hf import save_pretrained

    model = torch.nn.Linear(64, 64)
    results = []
    for i in range(n):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(writer * 1000 + i)  # the checkpoint's values say who wrote it, and when
        try:
            if hf:
                save_pretrained(model, path, overwrite=True)
            else:
                save_checkpoint(path, model, extra={"writer": writer, "i": i}, overwrite=True)
            results.append("ok")
        except (CheckpointError, FileExistsError) as e:
            results.append(f"CheckpointError: {e}")
        except BaseException as e:  # noqa: BLE001 - what must never escape; the test reports it
            results.append(f"RAW {type(e).__name__}: {e}")
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5:] == ["hf"])
