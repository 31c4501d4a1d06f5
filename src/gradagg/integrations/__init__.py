"""Exact accumulation inside the loops training frameworks own: one module per framework.

Each module imports its framework only when it is imported itself (``import gradagg`` and
``import gradagg.integrations`` import none), so a user of one framework needs none of the others.
"""
