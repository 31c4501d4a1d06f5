"""A pytest plugin for mutation testing (``make mutate``): a test that starts a local world is skipped.

mutmut runs each mutant's tests in a process it forks, and learns which tests reach which function from calls in
that process only: a rank's calls are not seen, and a world per mutant would cost seconds. The scoped mutation run
therefore uses the one-process tests; what only a world reaches is counted as "no tests" in its report
(bench/MUTATION.md), not as killed.
"""

from __future__ import annotations

from typing import Any, NoReturn

import pytest


def _skip(*args: Any, **kwargs: Any) -> NoReturn:
    pytest.skip("starts a local world: not run under mutation testing")


def pytest_configure(config: pytest.Config) -> None:
    import gradagg.testing as testing

    for name in ("run_local_world", "launch_local_world", "launch_process", "run_world"):
        setattr(testing, name, _skip)
