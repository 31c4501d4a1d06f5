"""Rank worker: the warnings ``exact(trainer)`` and the training it changes emit (issue 25).

transformers' Trainer on 2 CPU ranks builds DDP through Accelerate; with the tiny Llama (its only buffer, the
rotary ``inv_freq``, is non-persistent) ``exact()`` turns DDP's buffer broadcast off. It did so through Accelerate's
``DistributedDataParallelKwargs.broadcast_buffers``, which Accelerate passes to DDP's deprecated ``broadcast_buffers``
argument: a FutureWarning on every rank that reads as gradagg using a deprecated API.
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

from tests.integrations.workers import hf


def warnings_world() -> dict[str, Any]:
    """Apply ``exact()`` and train one epoch with every warning recorded; return those about DDP's buffer options,
    what wrapped the model and its forward buffer sync after training."""
    from gradagg.integrations.transformers import exact

    hf.launcher_environment()
    with tempfile.TemporaryDirectory() as out:
        trainer = hf.build_trainer({"exact": True}, out)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exact(trainer)
            trainer.train()
        ddp = trainer.model_wrapped
    return {
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught if "buffers" in str(w.message)],
        "from_gradagg": [f"{w.filename}: {w.message}" for w in caught if "/gradagg/" in w.filename],
        "wrapped": type(ddp).__name__,
        "forward_sync_buffers": getattr(ddp, "forward_sync_buffers", None),
    }
