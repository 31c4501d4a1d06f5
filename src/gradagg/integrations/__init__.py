"""gradagg inside the training loops people already run: one small module per framework.

Each module imports its framework only when it is used (``import gradagg.integrations`` imports none of them):

- :mod:`gradagg.integrations.transformers`: ``exact(trainer)`` for any ``transformers.Trainer`` (TRL's included);
- :mod:`gradagg.integrations.accelerate`: a custom Accelerate loop around :class:`~gradagg.torch.MicrobatchAccumulator`;
- :mod:`gradagg.integrations.lightning`: the ``ExactAccumulation`` callback;
- :mod:`gradagg.integrations.torchtitan`: torchtitan's model as ``parallelize`` leaves it.
"""
